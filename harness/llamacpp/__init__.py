"""llama.cpp as a second engine: a pinned build, GGUF conversion, llama-server lifecycle and
client, offload knobs, and llama-bench import.

Owns the infrastructure only; wiring it into the harness's engine plugin family (scenario
phases, rows per phase) lives with the harness. One module per concern:

  source        the pin: the hash-checked sdist, its extracted llama.cpp tree, the cache root
  build         pinned llama.cpp build into the cache (`python -m harness.llamacpp.build`)
  convert       HF checkpoint dir or moebench preset -> cached GGUF of a given type
  gguf_vocab    the pass-through vocabulary for tokenizer-less checkpoints (run by convert)
  flags         the offload/runtime knobs as a dataclass -> argv, checked against the build
  server        `LlamaServer`: one llama-server process, its health, its log, its memory
  client        the requests `LlamaServer` sends (typed, our port only, its stall watchdog)
  listener      which process listens on a port: the server answering is the one we started
  process       the servers as child processes: stopped with the harness, clean env, free port
  bench_import  llama-bench JSON/JSONL -> tidy rows + manifest

Submodules are imported on demand (`from harness.llamacpp.server import LlamaServer`), so
importing the package costs nothing.
"""
