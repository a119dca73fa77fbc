"""Loading: checkpoints (checkpoint.py), export folders and their manifests (export_folder.py, manifest.py), GGUF
sources (gguf.py). Nothing in a folder from somewhere else is executed or unpickled."""
