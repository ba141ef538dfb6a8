"""`lorafit export`: a finished run to files people run - a merged transformers folder, GGUF for llama.cpp,
Ollama and LM Studio (each checked in llama.cpp), and an Ollama Modelfile."""
