"""What the engine's CUDA paths share below the layers that use them (graphs.py: captured calls)."""
