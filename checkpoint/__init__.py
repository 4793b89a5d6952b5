"""Reading a user's checkpoint: a Hugging Face dir of safetensors, or a llama.cpp GGUF file, behind
one weight map (name → shape, dtype, bytes on demand, one tensor at a time) and one set of checks
on untrusted headers. Shared by the builder (export, quantization, Medusa heads) and the runtime
(``trtbuild eval``); it imports neither."""
