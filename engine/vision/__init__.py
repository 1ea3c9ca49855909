"""Images in the prompt: projectors from llama.cpp's mmproj GGUF files, run in MLX.

`mmproj` reads and checks the file (VisionSpec, Projector), `towers` holds one module per projector
type (its preprocessing, encoder, image markers and feeding; `gemma3`), built from `vit`'s shared
encoder operations and `preprocess`'s pieces of llama.cpp's resize policy and normalisation; `feed`
reads an image's embeddings into the text model; `spans` puts encoded images into a prompt's tokens and prefill (image spans keyed by the pixels'
digest, a bounded feature cache). docs/VISION.md describes them and the measured tolerances.
"""
