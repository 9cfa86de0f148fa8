"""tts-client: speak text into a WAV file (or raw PCM on stdout) through an audio-pipeline server; list voices."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import grpc
import soundfile

from audio_pipeline_client.client import TTSClient
from audio_pipeline_client.protocol import (EXTENSIONS, FLOAT32, FLUSH, STREAM_ENCODINGS, encode_samples,
                                             float_to_pcm16, parse_encoding)
from audio_pipeline_client.timings import timings_document
from audio_pipeline_client.transport import grpc_target
from audio_pipeline_client.types import AudioStreamChunk, TTSError

PROGRAM = "tts-client"
SERVER_ENVIRONMENT = "AUDIO_PIPELINE_SERVER"
TOKEN_ENVIRONMENT = "AUDIO_PIPELINE_TOKEN"
USAGE = f"""\
{PROGRAM} [--server HOST:PORT] (--text TEXT | --input FILE|-) [--live] (--output FILE.wav | --raw)
                  [--timings FILE.json|FILE.vtt] [options]
       {PROGRAM} voices [--server HOST:PORT] [--timeout S] [--wait-ready S] [--tls] [--ca-file PEM] [--token T]
       {PROGRAM} register-voice NAME --audio FILE --transcript TEXT [--description TEXT] [connection options]
       {PROGRAM} delete-voice NAME [connection options]"""
PROGRESS_LINE_SECONDS = 2.0
PROGRESS_REDRAW_SECONDS = 0.1


class CommandError(Exception):
    """A failure to report as one line, ``tts-client: error: <message>``, with exit status 1."""


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv`` (default: sys.argv[1:]) and returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["voices"]:
            return list_voices(voices_parser().parse_args(argv[1:]))
        if argv[:1] == ["register-voice"]:
            return register_voice(register_parser().parse_args(argv[1:]))
        if argv[:1] == ["delete-voice"]:
            return delete_voice(delete_parser().parse_args(argv[1:]))
        return synthesize(synthesize_parser().parse_args(argv))
    except SystemExit as exit_request:  # argparse: --help (0) or a usage error (2)
        return exit_request.code if isinstance(exit_request.code, int) else 2
    except (CommandError, TTSError) as error:
        return fail(str(error))
    except KeyboardInterrupt:
        return fail("interrupted", status=130)
    except Exception as error:  # noqa: BLE001 - a command line tool reports, it does not dump tracebacks
        return fail(f"unexpected {type(error).__name__}: {error}")


def fail(message: str, status: int = 1) -> int:
    print(f"{PROGRAM}: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def connection_arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--server", default=os.environ.get(SERVER_ENVIRONMENT, "localhost:50051"),
                        metavar="HOST:PORT",
                        help=f"server address (default: ${SERVER_ENVIRONMENT} or %(default)s); several replicas as "
                             "a comma-separated list of ip:port, or one dns:///NAME:PORT resolving to them all")
    parser.add_argument("--retry-on", action="append", default=[], metavar="CODE",
                        help="also retry this gRPC status before the first audio, repeatable (UNAVAILABLE always; "
                             "INTERNAL behind Ray Serve, whose proxy reports a replica that died as INTERNAL)")
    parser.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="metadata sent with every call, repeatable (application=tts for a Ray Serve proxy)")
    parser.add_argument("--timeout", type=positive_float, metavar="S", help="deadline of the call in seconds")
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system roots")
    parser.add_argument("--ca-file", metavar="PEM", help="connect with TLS, trusting these root certificates")
    parser.add_argument("--cert-file", metavar="PEM",
                        help="client certificate for a server that requires one (mutual TLS; with --key-file)")
    parser.add_argument("--key-file", metavar="PEM", help="private key of --cert-file")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENVIRONMENT),
                        help=f"bearer token sent as authorization metadata (default: ${TOKEN_ENVIRONMENT})")
    parser.add_argument("--wait-ready", type=positive_float, metavar="S",
                        help="first wait up to S seconds for the server to report SERVING (e.g. right after start)")
    return parser


def synthesize_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROGRAM, usage=USAGE, parents=[connection_arguments()],
                                     description="Speak text through an audio-pipeline server.",
                                     epilog=f"Run '{PROGRAM} voices --help' for the voice listing.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to speak")
    source.add_argument("--input", metavar="FILE", help="read the text from FILE (UTF-8), or '-' for stdin")
    sink = parser.add_mutually_exclusive_group(required=True)
    sink.add_argument("--output", metavar="FILE.wav", help="write a WAV file (replaced only on success)")
    sink.add_argument("--raw", action="store_true",
                      help="write raw little-endian PCM in --format to stdout, e.g. | aplay -f S16_LE -r 24000")
    parser.add_argument("--voice", help="voice name (see 'voices'; default: the server's default voice)")
    parser.add_argument("--reference-audio", metavar="FILE",
                        help="clone the voice of this recording (WAV/FLAC/OGG) for this request; needs "
                             "--reference-transcript")
    parser.add_argument("--reference-transcript", metavar="TEXT", help="the words spoken in --reference-audio")
    parser.add_argument("--sample-rate", type=positive_int, metavar="HZ", help="output rate (default: native)")
    parser.add_argument("--format", choices=["pcm16", "f32", "wav", "mp3", "opus", "aac", "flac", "mulaw", "alaw"],
                        help="audio format on the wire and in the output (default: from the --output name's "
                             "extension: .mp3, .opus/.ogg, .aac, .flac, .ulaw, .alaw; else pcm16). Encoded "
                             "formats are written as the server sends them; mulaw and alaw are 8 kHz unless "
                             "--sample-rate says otherwise")
    parser.add_argument("--seed", type=non_negative_int, help="random seed: same seed and text, same audio")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--stop-token-id", type=non_negative_int, action="append", metavar="ID",
                        help="an extra token id that ends the speech (repeatable)")
    parser.add_argument("--max-tokens", type=positive_int)
    parser.add_argument("--min-tokens", type=non_negative_int)
    parser.add_argument("--request-id", help="id echoed by the server and written to its logs")
    parser.add_argument("--live", action="store_true",
                        help="live text: send the input line by line as it is read (e.g. '--input - --live' with "
                             "another program writing to standard input); each sentence is spoken once complete, "
                             "an empty line speaks what came so far")
    parser.add_argument("--speed", type=positive_float, metavar="X",
                        help="speaking rate, 0.25 to 4.0 (2 is twice as fast, at the same pitch; default 1)")
    parser.add_argument("--no-normalize", dest="normalize_text", action="store_const", const=False,
                        help="speak the text as written (by default numbers, money, dates, units and the "
                             "like are read as words first, e.g. '$5' as 'five dollars')")
    parser.add_argument("--ssml", action="store_true", default=None,
                        help="the text is SSML (a text that starts with <speak is taken as SSML anyway)")
    parser.add_argument("--pronunciations", metavar="FILE",
                        help="how to say some words: a JSON list of {\"word\", \"phonemes\" (IPA)} or "
                             "{\"word\", \"respelling\"} objects")
    parser.add_argument("--timings", metavar="FILE",
                        help="write each word's start and end in the audio (and where it is in the text): "
                             "WebVTT captions when FILE ends in .vtt, JSON otherwise")
    parser.add_argument("--quiet", action="store_true", help="no progress line and no summary")
    return parser


def voices_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"{PROGRAM} voices", parents=[connection_arguments()],
                                   description="List the voices of an audio-pipeline server.")


def register_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROGRAM} register-voice", parents=[connection_arguments()],
                                     description="Register a cloned voice from a recording and its transcript.")
    parser.add_argument("name", help="the new voice's name (a-z, 0-9, '-', '_')")
    parser.add_argument("--audio", required=True, metavar="FILE", help="the reference recording (WAV/FLAC/OGG)")
    parser.add_argument("--transcript", required=True, help="the words spoken in the recording")
    parser.add_argument("--description", default="", help="shown by 'voices'")
    return parser


def delete_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROGRAM} delete-voice", parents=[connection_arguments()],
                                     description="Delete a registered voice.")
    parser.add_argument("name", help="the registered voice's name")
    return parser


def register_voice(args: argparse.Namespace) -> int:
    with connect(args) as client:
        voice = client.register_voice(args.name, Path(args.audio), args.transcript, description=args.description)
    print(f"registered voice {voice.name}")
    return 0


def delete_voice(args: argparse.Namespace) -> int:
    with connect(args) as client:
        client.delete_voice(args.name)
    print(f"deleted voice {args.name}")
    return 0


def positive_int(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {value}")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def connect(args: argparse.Namespace) -> TTSClient:
    try:
        metadata = []
        for pair in args.metadata:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise CommandError(f"--metadata: {pair!r} is not KEY=VALUE")
            metadata.append((key.strip().lower(), value))
        try:
            target = grpc_target(args.server.split(",") if "," in args.server and ":///" not in args.server
                                 else args.server)
        except ValueError as error:
            raise CommandError(f"--server: {error}") from error
        try:
            client = TTSClient(target, timeout=args.timeout, tls=args.ca_file or args.tls, token=args.token,
                               client_cert=args.cert_file, client_key=args.key_file, metadata=metadata,
                               retry_codes=["UNAVAILABLE", *args.retry_on])
        except ValueError as error:
            if "retry_codes" not in str(error):
                raise
            raise CommandError(str(error).replace("retry_codes", "--retry-on", 1)) from error
    except OSError as error:
        raise CommandError(describe_os_error(error, "read the CA file")) from error
    if args.wait_ready:
        try:
            client.wait_ready(args.wait_ready)
        except TTSError as error:
            client.close()
            raise CommandError(f"server {args.server} not ready after {args.wait_ready:g} s: {error}") from error
    return client


def describe_os_error(error: OSError, action: str) -> str:
    where = f" {error.filename}" if error.filename else ""
    return f"cannot {action}{where}: {error.strerror or error}"


def list_voices(args: argparse.Namespace) -> int:
    with connect(args) as client:
        voices = client.list_voices()
    rows = [("NAME", "LANGUAGE", "DEFAULT", "DESCRIPTION")]
    rows += [(voice.name, voice.language, "yes" if voice.is_default else "",
              f"[registered] {voice.description}".strip() if voice.registered else voice.description)
             for voice in voices]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def read_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    name = "standard input" if args.input == "-" else args.input
    try:
        data = sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()
        text = data.decode("utf-8")
    except OSError as error:
        raise CommandError(describe_os_error(error, "read the input")) from error
    except UnicodeDecodeError as error:
        raise CommandError(f"cannot read the input {name}: not UTF-8 text ({error.reason} at byte {error.start})")
    if not text.strip():
        raise CommandError(f"the input {name} has no text")
    return text.strip()


def live_lines(args: argparse.Namespace):
    """--live: the input's lines as they come (each joined to the next with a space); an empty
    line flushes (speaks what came so far)."""
    if args.text is not None:
        yield args.text
        return
    stream = sys.stdin.buffer if args.input == "-" else open(args.input, "rb")  # noqa: SIM115
    try:
        for number, raw in enumerate(iter(stream.readline, b""), 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                raise CommandError(f"input line {number} is not UTF-8 text ({error.reason})") from None
            yield FLUSH if not line.strip() else line + " "
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def read_pronunciations(path: str | None) -> list[dict] | None:
    """The entries of a --pronunciations file (the server checks them; here only their form)."""
    if path is None:
        return None
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CommandError(f"--pronunciations {path}: {error}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("word"), str) for e in entries):
        raise CommandError(f"--pronunciations {path}: must be a JSON list of objects with a word")
    return entries


def synthesize(args: argparse.Namespace) -> int:
    if args.live and args.reference_audio is not None:
        raise CommandError("--reference-audio cannot be used with --live")
    if args.live and args.input not in (None, "-") and not Path(args.input).is_file():
        raise CommandError(f"cannot read the input {args.input}: no such file")
    text = None if args.live else read_text(args)
    if (args.reference_audio is None) != (args.reference_transcript is None):
        raise CommandError("--reference-audio and --reference-transcript go together")
    reference_audio = Path(args.reference_audio) if args.reference_audio else None
    suffix = Path(args.output).suffix.lower() if args.output else ""
    named = EXTENSIONS.get(suffix, "wav" if suffix == ".wav" else None)
    if args.format and named and args.format != named and not (named == "wav" and args.format in ("pcm16", "f32")):
        raise CommandError(f"--format {args.format} does not match the output name {args.output} "
                           f"(which says {named}); change one of them")
    name = args.format or (EXTENSIONS.get(suffix, "pcm16") if args.output else "pcm16")
    if name == "wav" and args.output:
        name = "pcm16"  # a WAV file with its real sizes, from PCM16 on the wire
    encoding = parse_encoding(name)
    if name in STREAM_ENCODINGS:
        sink = EncodedSink(Path(args.output) if args.output else None, name)
    else:
        sink = RawSink(encoding) if args.raw else WavSink(Path(args.output), encoding)
    try:
        timings = TimingsFile(Path(args.timings)) if args.timings else None
    except CommandError:
        sink.discard()  # the audio's temporary file goes too
        raise
    progress = Progress(quiet=args.quiet)
    try:
        options = dict(voice=args.voice, seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       repetition_penalty=args.repetition_penalty, sample_rate=args.sample_rate, encoding=encoding,
                       request_id=args.request_id, min_p=args.min_p, frequency_penalty=args.frequency_penalty,
                       presence_penalty=args.presence_penalty, stop_token_ids=args.stop_token_id,
                       normalize_text=args.normalize_text, speed=args.speed,
                       pronunciations=read_pronunciations(args.pronunciations))
        if args.ssml and args.live:
            raise CommandError("--ssml takes a whole text (live text is plain text)")
        if not args.live:
            options["ssml"] = args.ssml
        with connect(args) as client:
            chunks = (client.stream_text(live_lines(args), **options) if args.live else
                      client.stream(text, reference_audio=reference_audio,
                                    reference_transcript=args.reference_transcript, **options))
            for chunk in chunks:
                sink.write(chunk)
                if timings is not None:
                    timings.add(chunk)
                progress.update(chunk)
        sink.commit()
        if timings is not None:
            timings.commit()
    except BaseException as error:
        sink.discard()
        if timings is not None:
            timings.discard()
        progress.clear()
        if isinstance(error, TTSError) and error.code == grpc.StatusCode.UNAVAILABLE:
            raise CommandError(f"server {args.server}: {error}") from error
        if isinstance(error, BrokenPipeError):
            raise CommandError("standard output was closed") from error
        raise
    progress.finish(f"wrote {sink.description}: {progress.summary()}")
    return 0


class PendingFile:
    """A hidden temporary file beside ``path``, renamed onto ``path`` once the output is complete.
    It is created at once, so an output that cannot be written fails before the server does any work."""

    def __init__(self, path: Path, what: str):
        self.path = path
        self.what = what
        if path.is_dir():
            raise CommandError(f"cannot write {path}: it is a directory")
        self.temporary_path = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            self.temporary_path.touch(exist_ok=False)
        except OSError as error:
            raise self.error(error) from error

    def error(self, error: OSError) -> CommandError:
        return CommandError(f"cannot write {self.what} {self.path}: {error.strerror or error}")

    def publish(self) -> None:
        try:
            os.replace(self.temporary_path, self.path)
        except OSError as error:
            raise self.error(error) from error

    def remove(self) -> None:
        self.temporary_path.unlink(missing_ok=True)


def close_file(pending: PendingFile, file) -> None:
    """Closes ``file`` (flushing it), reporting a failure as the output's."""
    try:
        file.close()
    except OSError as error:
        raise pending.error(error) from error


class WavSink:
    """Writes the stream into a hidden temporary file beside ``path``, renamed onto ``path`` on success."""

    def __init__(self, path: Path, encoding: int):
        self.encoding = encoding
        self.description = str(path)
        self.pending = PendingFile(path, "the output")
        self.file: soundfile.SoundFile | None = None

    def write(self, chunk: AudioStreamChunk) -> None:
        if self.file is None:
            subtype = "FLOAT" if self.encoding == FLOAT32 else "PCM_16"
            self.file = soundfile.SoundFile(self.pending.temporary_path, "w", samplerate=chunk.sample_rate,
                                            channels=1, subtype=subtype, format="WAV")
        if chunk.samples.size:
            # int16 into a PCM_16 file keeps the server's samples bit for bit.
            self.file.write(chunk.samples if self.encoding == FLOAT32 else float_to_pcm16(chunk.samples))

    def commit(self) -> None:
        close_file(self.pending, self.file)
        self.pending.publish()

    def discard(self) -> None:
        if self.file is not None and not self.file.closed:
            self.file.close()
        self.pending.remove()


class TimingsFile:
    """--timings: collects the stream's word timings, written to ``path`` (through a temporary
    file beside it) once the audio is complete."""

    def __init__(self, path: Path):
        self.pending = PendingFile(path, "the timings")
        self.words: list = []

    def add(self, chunk: AudioStreamChunk) -> None:
        self.words += chunk.words

    def commit(self) -> None:
        try:
            self.pending.temporary_path.write_text(timings_document(self.words, str(self.pending.path)),
                                                   encoding="utf-8")
        except OSError as error:
            raise self.pending.error(error) from error
        self.pending.publish()

    def discard(self) -> None:
        self.pending.remove()


class EncodedSink:
    """Writes an encoded stream's bytes as they come: into a hidden temporary file beside ``path``
    (renamed onto it on success), or to stdout when ``path`` is None (--raw)."""

    def __init__(self, path: Path | None, name: str):
        self.bytes_written = 0
        self.file = None
        self.pending = None
        self.description = f"{name} to standard output" if path is None else str(path)
        if path is not None:
            self.pending = PendingFile(path, "the output")
            try:
                self.file = open(self.pending.temporary_path, "wb")  # noqa: SIM115 - closed in commit/discard
            except OSError as error:
                self.pending.remove()
                raise self.pending.error(error) from error

    def write(self, chunk: AudioStreamChunk) -> None:
        if not chunk.data:
            return
        if self.file is None:
            sys.stdout.buffer.write(chunk.data)
            sys.stdout.buffer.flush()
        else:
            self.file.write(chunk.data)
        self.bytes_written += len(chunk.data)

    def commit(self) -> None:
        if self.file is None:
            self.description = f"{self.bytes_written} bytes of {self.description}"
            return
        close_file(self.pending, self.file)
        self.pending.publish()

    def discard(self) -> None:
        if self.file is not None:
            self.file.close()
            self.pending.remove()


class RawSink:
    """Writes the samples to stdout as little-endian PCM in the requested encoding, flushed per chunk."""

    def __init__(self, encoding: int):
        self.encoding = encoding
        self.bytes_written = 0
        self.description = "raw audio to standard output"

    def write(self, chunk: AudioStreamChunk) -> None:
        if chunk.samples.size:
            data = encode_samples(chunk.samples, self.encoding)
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            self.bytes_written += len(data)

    def commit(self) -> None:
        self.description = f"{self.bytes_written} bytes of raw audio to standard output"

    def discard(self) -> None:
        try:
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            # Keep the interpreter's own exit-time flush from failing on the closed pipe again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class Progress:
    """The stderr progress line: redrawn in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.terminal = sys.stderr.isatty()
        self.started = time.monotonic()
        self.first_audio: float | None = None
        self.audio_seconds = 0.0
        self.sample_rate = 0
        self.chunks = 0
        self.stop_reason = ""
        self.last_shown = self.started
        self.shown_width = 0

    def update(self, chunk: AudioStreamChunk) -> None:
        now = time.monotonic()
        self.sample_rate = chunk.sample_rate
        if chunk.final:
            self.stop_reason = chunk.stop_reason or ""
        elif chunk.samples.size or chunk.num_samples:
            if self.first_audio is None:
                self.first_audio = now - self.started
            self.audio_seconds += (chunk.samples.size or chunk.num_samples) / chunk.sample_rate
            self.chunks += 1
        if self.quiet or now - self.last_shown < (PROGRESS_REDRAW_SECONDS if self.terminal else PROGRESS_LINE_SECONDS):
            return
        self.last_shown = now
        line = f"{self.audio_seconds:7.2f} s of audio, {self.chunks} chunks, {now - self.started:.1f} s elapsed"
        if self.terminal:
            sys.stderr.write("\r" + line.ljust(self.shown_width))
            self.shown_width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def summary(self) -> str:
        first = "no audio" if self.first_audio is None else f"first audio after {self.first_audio:.2f} s"
        return (f"{self.audio_seconds:.2f} s of audio at {self.sample_rate} Hz, {first}, "
                f"{time.monotonic() - self.started:.2f} s in all ({self.stop_reason})")

    def clear(self) -> None:
        if self.shown_width:
            sys.stderr.write("\r" + " " * self.shown_width + "\r")
            sys.stderr.flush()
            self.shown_width = 0

    def finish(self, message: str) -> None:
        self.clear()
        if not self.quiet:
            print(message, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
