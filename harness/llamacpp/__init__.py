"""llama.cpp as a second engine, one plugin package: its engine adapter, a pinned build, GGUF
conversion, llama-server lifecycle and client, offload knobs, and llama-bench import.

Everything llama.cpp is lives here: the harness reaches it through one registry line
(`harness.engines.registry.ENGINES["llamacpp"]` -> `adapter.LlamaCppAdapter`), whose declarations
-- capabilities, knobs (its `Options`, the `engine.*` config group), knob columns, own checks and
sub-commands -- are all core code asks. Deleting this package and that line leaves the rest of
moebench working (tests/test_plugin_removal.py). One module per concern:

  adapter       `engine=llamacpp`: the scenario's phases as llama-server requests, its rows, its checks
  source        the pin: the hash-checked sdist, its extracted llama.cpp tree, its place in the cache
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
