"""Images in the prompt: projectors from llama.cpp's mmproj GGUF files, run in MLX.

`mmproj` reads and checks the file (VisionSpec, Projector), `preprocess` makes an image what the
projector reads (llama.cpp's resize policy and normalisation), `siglip` is the gemma3 tower,
`spans` puts encoded images into a prompt's tokens and prefill (image spans keyed by the pixels'
digest, a bounded feature cache). docs/VISION.md describes them and the measured tolerances.
"""
