"""HFCausalLMTask: a Hugging Face `transformers` causal LM, trained by stalwart.

A small Llama-architecture model is built from a config (random init, nothing downloaded).
Its data is a `datasets` dataset built from local text files (by default the Python standard
library's top-level modules), with a byte-level BPE tokenizer trained on them by `tokenizers`.
Batches are Hugging Face dicts ({"input_ids", "labels"}); the default loss calls
`model(**batch)` and takes the model's own loss. `export_files` hands the model's config and
the tokenizer to `stalwart export --format hf`, so `from_pretrained` loads the result.

Needs `pip install 'stalwart[hf]'`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sysconfig
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stalwart.core.errors import TaskError
from stalwart.core.task import ModelDims, TrainTask

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

NEEDS_HF = "HFCausalLMTask needs transformers, datasets and tokenizers: pip install 'stalwart[hf]'"
SPECIAL = ["<|endoftext|>"]  # ends each document; also the model's bos, eos and pad token
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DONE = "done.json"


def _split(rel: str, val_fraction: float) -> str:
    # A hash of the path, not its position: the same split on every machine.
    return "validation" if zlib.crc32(rel.encode()) % 10_000 < val_fraction * 10_000 else "train"


class TokenChunks:
    """A split's token chunks (a `datasets` Dataset on disk) as dict batches."""

    def __init__(self, path: Path) -> None:
        import datasets

        self.data = datasets.load_from_disk(str(path)).with_format("torch")

    def __len__(self) -> int:
        return len(self.data)

    def get_batch(self, indices: Any) -> dict[str, torch.Tensor]:
        ids = self.data[[int(i) for i in indices]]["input_ids"]
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


class HFCausalLMTask(TrainTask):
    def __init__(self, *, text_dir: str = "", text_glob: str = "*.py", vocab_size: int = 2048,
                 seq_len: int = 128, hidden_size: int = 128, n_layers: int = 2,
                 n_heads: int = 4, intermediate_size: int = 344,
                 tie_embeddings: bool = True, val_fraction: float = 0.1) -> None:
        ints = {"vocab_size": vocab_size, "seq_len": seq_len, "hidden_size": hidden_size,
                "n_layers": n_layers, "n_heads": n_heads,
                "intermediate_size": intermediate_size}
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"task.args.{name} = {value!r} is invalid: must be an int >= 1")
        if vocab_size < 300:
            raise ValueError(f"task.args.vocab_size = {vocab_size} is invalid: must be >= 300 "
                             f"(256 bytes and the merges)")
        if hidden_size % n_heads:
            raise ValueError(f"task.args.n_heads = {n_heads} is invalid: must divide "
                             f"hidden_size = {hidden_size}")
        if not isinstance(val_fraction, float) or not 0 < val_fraction < 1:
            raise ValueError(f"task.args.val_fraction = {val_fraction!r} is invalid: must be "
                             f"a number between 0 and 1 (exclusive)")
        if not isinstance(tie_embeddings, bool):
            raise ValueError(f"task.args.tie_embeddings = {tie_embeddings!r} is invalid: "
                             f"must be true or false")
        if any(importlib.util.find_spec(m) is None
               for m in ("transformers", "datasets", "tokenizers")):
            raise TaskError(NEEDS_HF)
        self.text_dir = Path(text_dir or sysconfig.get_paths()["stdlib"]).expanduser()
        if not self.text_dir.is_dir():
            raise ValueError(f"task.args.text_dir = {text_dir!r} is not a directory")
        self.text_glob = text_glob
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.hidden_size, self.n_layers, self.n_heads = hidden_size, n_layers, n_heads
        self.intermediate_size = intermediate_size
        self.tie_embeddings = tie_embeddings
        self.val_fraction = val_fraction

    # ------------------------------------------------------------------ data

    def _files(self) -> list[tuple[str, Path]]:
        files = sorted((p.relative_to(self.text_dir).as_posix(), p)
                       for p in self.text_dir.glob(self.text_glob) if p.is_file())
        if not files:
            raise TaskError(f"task.args.text_glob = {self.text_glob!r} matches no file under "
                            f"{self.text_dir}")
        return files

    def _data_dir(self, config: JobConfig) -> Path:
        """Where the tokenizer and the token chunks live: keyed by everything they depend
        on, so another corpus or vocabulary never reads a stale one."""
        listing = [(rel, (st := p.stat()).st_size, st.st_mtime_ns) for rel, p in self._files()]
        key = hashlib.sha256(json.dumps([str(self.text_dir), listing, self.vocab_size,
                                         self.seq_len, self.val_fraction]).encode())
        return Path(config.data.cache_dir).expanduser() / f"hf-{key.hexdigest()[:16]}"

    def prepare_data(self, config: JobConfig) -> None:
        """Train the tokenizer and cut the text into chunks, once per machine (a file lock
        lets the workers of a node share the work; a marker written last says it is done)."""
        from filelock import FileLock

        out = self._data_dir(config)
        if (out / DONE).exists():
            return
        out.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not (out / DONE).exists():
                self._build(out)

    def _build(self, out: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only, never the Hub
        import datasets
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        datasets.disable_progress_bars()  # a worker's log is no terminal

        files = self._files()
        splits = {"train": [], "validation": []}
        for rel, path in files:
            splits[_split(rel, self.val_fraction)].append(str(path))
        if not splits["train"] or not splits["validation"]:
            raise TaskError(f"task.args.val_fraction = {self.val_fraction} leaves a split of "
                            f"the {len(files)} files empty")
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train(splits["train"], trainers.BpeTrainer(
            vocab_size=self.vocab_size, special_tokens=SPECIAL, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL[0],
                                       eos_token=SPECIAL[0], pad_token=SPECIAL[0])
        fast.save_pretrained(str(out / "tokenizer"))

        text = datasets.load_dataset("text", data_files=splits, sample_by="document",
                                     cache_dir=str(out / "hf-cache"))
        eos = tokenizer.token_to_id(SPECIAL[0])
        n = self.seq_len

        def chunks(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
            ids = [i for enc in tokenizer.encode_batch(batch["text"]) for i in [*enc.ids, eos]]
            return {"input_ids": [ids[k:k + n] for k in range(0, len(ids) - n + 1, n)]}

        for split, data in text.items():
            data.map(chunks, batched=True, remove_columns=["text"]).save_to_disk(
                str(out / split))
        (out / DONE).write_text(json.dumps({s: len(f) for s, f in splits.items()}))

    def train_dataset(self, config: JobConfig) -> TokenChunks:
        return TokenChunks(self._data_dir(config) / "train")

    def val_dataset(self, config: JobConfig) -> TokenChunks:
        return TokenChunks(self._data_dir(config) / "validation")

    # ------------------------------------------------------------------ model

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads, num_key_value_heads=self.n_heads,
            max_position_embeddings=self.seq_len, tie_word_embeddings=self.tie_embeddings,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
            architectures=["LlamaForCausalLM"])

    def build_model(self, config: JobConfig) -> torch.nn.Module:
        from transformers import LlamaForCausalLM

        # Weights are drawn from torch's global RNG, which stalwart seeds first.
        return LlamaForCausalLM(self.hf_config())

    def init_weights(self, model: torch.nn.Module) -> None:
        """The model initialised itself when built (from the seeded RNG)."""

    def model_dims(self, model: torch.nn.Module) -> ModelDims:
        return ModelDims(n_layers=self.n_layers, d_model=self.hidden_size,
                         n_heads=self.n_heads, seq_len=self.seq_len,
                         vocab_size=self.vocab_size, ffn_hidden=self.intermediate_size)

    def export_files(self, config: JobConfig) -> dict[str, bytes]:
        """config.json and the tokenizer's files, for `stalwart export --format hf`."""
        hf = self.hf_config()
        hf.use_cache = True  # for generate() after export
        files = {"config.json": hf.to_json_string().encode()}
        tokenizer_dir = self._data_dir(config) / "tokenizer"
        for name in TOKENIZER_FILES:
            files[name] = (tokenizer_dir / name).read_bytes()
        return files
