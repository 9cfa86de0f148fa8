"""`audio-pipeline`: serve (gRPC server), synthesize (in-process text to WAV), config (print settings)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PROG = "audio-pipeline"


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration (later sources win: defaults < --config-file < "
                                      "AUDIO_PIPELINE_* environment < flags)")
    group.add_argument("--model", metavar="PATH",
                       help="local Hugging Face model directory, or builtin:NAME (default: the built-in model)")
    group.add_argument("--audio-decoder", metavar="NAME", help="audio decoder (default: snac)")
    group.add_argument("--audio-decoder-weights", metavar="PATH",
                       help="decoder weights directory or file (default: the ones shipped with the model)")
    group.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and activation dtype, prompt positions' products included (default: auto)")
    group.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                       help="any configuration field, e.g. chunk_size=28,56,112 or sampling.temperature=0.5 "
                            "(repeatable; see `audio-pipeline config`)")
    group.add_argument("--config-file", metavar="FILE", help="YAML or TOML configuration file")
    group.add_argument("--section-name", metavar="NAME", help="section of --config-file to read")
    group.add_argument("--log-level", default=os.environ.get("AUDIO_PIPELINE_LOG_LEVEL", "INFO"),
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default: INFO)")


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (default: plaintext, no authentication)")
    group.add_argument("--tls-cert-file", metavar="PEM", help="serve TLS with this certificate (chain); needs "
                                                              "--tls-key-file")
    group.add_argument("--tls-key-file", metavar="PEM", help="private key of --tls-cert-file")
    group.add_argument("--tls-client-ca-file", metavar="PEM",
                       help="mutual TLS: clients must present a certificate signed by this CA")
    group.add_argument("--auth-token-file", metavar="FILE",
                       help="require 'authorization: Bearer <token>' on every RPC but health and reflection; one "
                            "token a line, '#' comments (also: $AUDIO_PIPELINE_AUTH_TOKENS, comma-separated; the "
                            "tokens of both are accepted)")
    group.add_argument("--admin-token-file", metavar="FILE",
                       help="RegisterVoice and DeleteVoice need one of these tokens, which also pass wherever a "
                            "client token does; same format (also: $AUDIO_PIPELINE_ADMIN_TOKENS)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Text-to-speech serving engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the server (gRPC, and HTTP with --http-port)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051; 0 picks a free one)")
    serve.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus /metrics on PORT (default 8001 when prometheus_metrics_mode launches a server)")
    serve.add_argument("--http-port", type=int, metavar="PORT",
                       help="also serve HTTP on PORT: OpenAI-compatible POST /v1/audio/speech, /v1/models, "
                            "/v1/audio/voices, /health, /metrics (default: off; 0 picks a free port)")
    serve.add_argument("--metrics-host", metavar="HOST",
                       help="address /metrics listens on (default: the same as --host; e.g. 127.0.0.1 keeps it local)")
    _add_security_flags(serve)
    _add_config_flags(serve)

    from audio_pipeline.server import ray_cli

    ray_serve = commands.add_parser("serve-ray", help="run replicas of the server on Ray Serve (the ray extra)")
    ray_cli.add_arguments(ray_serve)
    _add_config_flags(ray_serve)

    synth = commands.add_parser("synthesize", help="synthesize text to a WAV file in-process (no server)")
    source = synth.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="text to speak")
    source.add_argument("--input", metavar="FILE", help="read the text from FILE ('-' for standard input)")
    synth.add_argument("--output", "-o", required=True, metavar="WAV", help="WAV file to write")
    synth.add_argument("--voice", help="voice name (default: the model's default voice)")
    synth.add_argument("--seed", type=int, help="sampling seed (same seed, same audio)")
    synth.add_argument("--max-tokens", type=int, help="largest number of speech tokens to generate")
    synth.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    synth.add_argument("--sample-rate", type=int, default=0, help="output sample rate (default: the model's)")
    _add_config_flags(synth)

    show = commands.add_parser("config", help="print the resolved configuration as JSON")
    _add_config_flags(show)
    return parser


def load_config(args: argparse.Namespace):
    """The configuration from every source, checked (the audio decoder's streaming settings too)."""
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.decoders.settings_check import check_decoder_settings

    return check_decoder_settings(AudioGenerationConfig.load(config_file=args.config_file,
                                                             section_name=args.section_name,
                                                             audio_flags=args.task_arg, **config_overrides(args)))


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration the command-line flags set (over the file and the environment)."""
    overrides: dict[str, Any] = {}
    model: dict[str, Any] = {}
    if args.model:
        model["model_path"] = args.model
    if args.device:
        model["device"] = args.device
    if args.dtype:
        model["dtype"] = args.dtype
    if model:
        overrides["model"] = model
    if args.audio_decoder:
        overrides["audio_decoder"] = args.audio_decoder
    if args.audio_decoder_weights:
        overrides["audio_decoder_weights"] = args.audio_decoder_weights
    return overrides


def read_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    if args.input == "-":
        return sys.stdin.read()
    try:
        return Path(args.input).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--input: cannot read {args.input}: {exc.strerror}") from None


def run_serve(args: argparse.Namespace, config) -> None:
    from audio_pipeline.server.app import ServerOptions, serve
    from audio_pipeline.service.auth import AuthTokens
    from audio_pipeline.server.tls import TLSFiles

    config.log_basic_config()
    options = ServerOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                            metrics_host=args.metrics_host,
                            tls=TLSFiles(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file),
                            auth=AuthTokens.load(args.auth_token_file, args.admin_token_file),
                            on_listening=lambda port: print(f"{PROG}: listening on {args.host}:{port}",
                                                            file=sys.stderr, flush=True),
                            http_port=args.http_port,
                            on_http_listening=lambda port: print(f"{PROG}: HTTP listening on {args.host}:{port}",
                                                                 file=sys.stderr, flush=True))
    asyncio.run(serve(config, options))


def run_synthesize(args: argparse.Namespace, config) -> None:
    """Text to a WAV file through the speech service in this process (segmented as a server would)."""
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.service.request import SpeechRequest
    from audio_pipeline.service.speech import SpeechService, gather

    text = read_text(args)
    sampling = {name: value for name, value in (("seed", args.seed), ("max_tokens", args.max_tokens),
                                                 ("temperature", args.temperature)) if value is not None}
    request = SpeechRequest(text=text, voice=args.voice, sampling=sampling, format="wav",
                            sample_rate=args.sample_rate, streamed=False)

    async def speak():
        service = SpeechService(engine)
        service.ready = True
        try:
            return await gather(await service.open(request))
        finally:
            service.close()

    engine = TTSEngine(config)
    engine.start()
    try:
        data, done = asyncio.run(speak())
    finally:
        engine.stop(0.0)
    target = Path(args.output)
    with tempfile.NamedTemporaryFile(dir=target.parent or ".", suffix=".wav", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)
    print(f"{PROG}: wrote {target} ({done.audio_seconds:.2f} s at {done.sample_rate} Hz, "
          f"{done.usage.generated_tokens} tokens, {done.stop_reason.value})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from audio_pipeline.errors import RequestError

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
        if args.command == "config":
            print(json.dumps(config.to_display_dict(), indent=2, default=str))
        elif args.command == "serve":
            run_serve(args, config)
        elif args.command == "serve-ray":
            from audio_pipeline.server import ray_cli

            config.log_basic_config()
            ray_cli.run(args, config_overrides(args))
        else:
            run_synthesize(args, config)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RequestError) as exc:
        if args.log_level == "DEBUG":
            raise
        message = str(exc).strip().splitlines()
        print(f"{PROG}: error: {' '.join(line.strip() for line in message)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
