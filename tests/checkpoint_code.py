"""Code planted in a copy of a real checkpoint, the way Hub checkpoints ship it: `.py` files beside
the weights that an `auto_map` names. Importing the code writes a marker file, so a test can tell
whether any loader ran it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def _with_auto_map(path: Path, auto_map: dict) -> None:
    d = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**d, "auto_map": auto_map}, indent=2))


def _marking(marker: Path, body: str) -> str:
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text(__name__)\n{body}"


def with_tokenizer_code(src: Path, dest: Path, marker: Path) -> Path:
    """`src` copied to `dest` with a tokenizer class in tokenization_marker.py, named by
    tokenizer_config.json's auto_map (what AutoTokenizer imports under trust_remote_code=True)."""
    shutil.copytree(src, dest)
    (dest / "tokenization_marker.py").write_text(_marking(marker, (
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class MarkerTokenizer(PreTrainedTokenizerFast):\n    pass\n")))
    cfg = dest / "tokenizer_config.json"
    _with_auto_map(cfg, {"AutoTokenizer": ["tokenization_marker.MarkerTokenizer", None]})
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "MarkerTokenizer"}, indent=2))
    return dest


def with_mixtral_model_code(src: Path, dest: Path, marker: Path) -> Path:
    """A Mixtral checkpoint `src` copied to `dest` with its config and model classes in .py files
    (working subclasses of transformers' Mixtral), named by config.json's auto_map (what
    from_pretrained imports under trust_remote_code=True)."""
    shutil.copytree(src, dest)
    (dest / "configuration_marker.py").write_text(_marking(marker, (
        "from transformers import MixtralConfig\n\n\n"
        "class MarkerConfig(MixtralConfig):\n    pass\n")))
    (dest / "modeling_marker.py").write_text(_marking(marker, (
        "from transformers import MixtralForCausalLM\n"
        "from .configuration_marker import MarkerConfig\n\n\n"
        "class MarkerForCausalLM(MixtralForCausalLM):\n    config_class = MarkerConfig\n")))
    _with_auto_map(dest / "config.json", {"AutoConfig": "configuration_marker.MarkerConfig",
                                          "AutoModelForCausalLM": "modeling_marker.MarkerForCausalLM"})
    return dest
