"""Tiny transformers models for the tests (built in a child process: importing transformers
sets HF_HUB_OFFLINE, which the test process must not leak), and the fns tests run on ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
TINY_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 96,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_BERT = {
    "model_type": "t5",
    "vocab_size": 96,
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_layers": 1,
    "num_heads": 4,
}


def write_config(directory, values: dict) -> Path:
    """A config.json as save_pretrained writes it (without importing transformers)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(values, indent=1))
    return directory


def save_pretrained_tiny(directory, values: dict, seed: int = 7) -> str:
    """In a child: a tiny model with random weights saved with save_pretrained (safetensors)."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # not the init's plain values: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    return str(directory)


def tokens_for(vocab: int, rows: int = 4, length: int = 17, seed: int = 11):
    import torch

    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def shard_and_report(ctx):
    """fn on every rank: the adapter of ``ctx.spec.training`` builds, shards and fills the
    model (init or pretrained); rank 0 saves the full state; every rank reports its loss on
    one fixed batch and how many parameter elements it holds."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hpc_hsdp.models.weights import tied_groups
    from hpc_hsdp.task.parallelism.hsdp import wrap_hsdp

    training = ctx.spec.training
    adapter = adapter_for(training)
    model = adapter.build_meta()
    units = adapter.shard_units(model)
    wrap_hsdp(model, ctx.mesh, block=units)
    model.to_empty(device=ctx.device)
    if adapter.has_pretrained_weights:
        adapter.load_pretrained(model)
    else:
        adapter.init_weights(model, seed=training.optimizer.seed)
    tokens = tokens_for(adapter.vocab_size)
    loss = adapter.loss(model, tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.is_rank0:
        torch.save(full, ctx.run_dir / "full_state.pt")
    params = list(model.parameters())
    tied = [group for group in tied_groups(model)]
    return {
        "rank": ctx.rank,
        "loss": float(loss),
        "units": sorted(u.__name__ for u in units),
        "tied": tied,
        "local_numel": sum(p.to_local().numel() for p in params),
        "total_numel": sum(p.numel() for p in params),
    }


def adapter_for(training):
    if training.model.name.startswith("hf:"):
        from hpc_hsdp.models.hf import HFAdapter

        return HFAdapter(training)
    from hpc_hsdp.models.factory import FactoryAdapter

    return FactoryAdapter(training)


def unsharded_reference(model_option: str, seed: int, state_path, training_values: dict | None = None):
    """In a child: the same adapter on one process without FSDP; its state equals the
    sharded one bit for bit, and its loss with transformers' own labels equals ours."""
    import torch

    from hpc_hsdp.job.spec import TrainingSpec

    adapter = adapter_for(TrainingSpec.of(model=model_option, seed=seed, **(training_values or {})))
    model = adapter.build_meta()
    model.to_empty(device="cpu")
    if adapter.has_pretrained_weights:
        adapter.load_pretrained(model)
    else:
        adapter.init_weights(model, seed=seed)
    sharded = torch.load(state_path, weights_only=True)
    ours = model.state_dict()
    differ = sorted(k for k in sharded if not torch.equal(sharded[k], ours[k]))
    tokens = tokens_for(adapter.vocab_size)
    with torch.no_grad():
        hf_loss = float(model(input_ids=tokens, labels=tokens).loss) if model_option.startswith("hf:") else None
        our_loss = float(adapter.loss(model, tokens[:, :-1], tokens[:, 1:]))
    stds = {k: float(v.std()) for k, v in ours.items() if v.dim() == 2}
    return {
        "differ": differ,
        "keys": sorted(sharded) == sorted(k for k in ours if k in sharded),
        "n": len(sharded),
        "hf_loss": hf_loss,
        "our_loss": our_loss,
        "stds": stds,
        "range": getattr(getattr(model, "config", None), "initializer_range", None),
    }


def from_pretrained_loss(directory: str):
    """In a child: transformers' own loading of the directory, and its loss on the fixed batch."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    tokens = tokens_for(model.config.vocab_size)
    with torch.no_grad():
        return float(model(input_ids=tokens, labels=tokens).loss)


# ----------------------------------------------------------------------------- the loop on a real corpus

CORPUS_FILES = ("argparse.py", "ast.py", "dataclasses.py", "functools.py", "inspect.py", "pathlib.py", "typing.py")


def make_corpus(root: str, vocab_size: int = 320) -> dict:
    """A few of the standard library's own files through the real `hpc-hsdp prepare-data`
    (a byte-level BPE of ``vocab_size`` ids trained on them, a held-out split)."""
    import sysconfig

    from cli_helpers import hpc

    stdlib = sysconfig.get_paths()["stdlib"]
    args = [
        "prepare-data",
        *(os.path.join(stdlib, n) for n in CORPUS_FILES),
        "-o",
        root,
        "--train-tokenizer",
        str(vocab_size),
        "--val-fraction",
        "0.2",
        "--workers",
        "1",
    ]
    done = hpc(*args, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((Path(root) / "dataset.json").read_text())
    return {"path": root, "vocab_size": manifest["vocab_size"], "tokens": manifest["num_tokens"]["train"]}


def _train_hf(ctx, *, signal_at=None):
    import os
    import signal

    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.training.loop import train

    training = ctx.spec.training
    records = {}

    def on_step(step, record):
        records[step] = {"loss": record["loss"], "sample_ids": record["sample_ids"]}
        if signal_at is not None and step == signal_at - 1 and ctx.rank == 3:  # agreed in step signal_at's all_reduce
            os.kill(os.getpid(), signal.SIGUSR2)

    adapter = resolve_model(training, data_vocab_size=None)
    result = train(ctx, training, adapter=adapter, on_step=on_step)
    params = list(result.model.parameters())
    out = {
        "summary": result.summary(ctx),
        "records": records,
        "local_numel": sum(p.to_local().numel() for p in params),
        "total_numel": sum(p.numel() for p in params),
    }
    if not result.stopped:
        import torch

        result.model.eval()
        with torch.no_grad():
            logits = adapter.logits(result.model, tokens_for(adapter.vocab_size, rows=2, length=16))
        out["logits"] = logits.float().tolist() if ctx.is_rank0 else None
    return out


def train_hf(ctx):
    return _train_hf(ctx)


def train_hf_signalled_at_3(ctx):
    return _train_hf(ctx, signal_at=3)


def exported_logits(directory: str):
    """In a child: transformers loads the exported directory; its logits on the fixed input."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens_for(model.config.vocab_size, rows=2, length=16)).logits
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"))
    return {"logits": logits.tolist(), "decoded": tokenizer.decode(tokenizer.encode("def f(x):\n    return x"))}


def first_step_reference(model_dir: str, data_path: str, seq_len: int, sample_ids: list[int]):
    """In a child: transformers' own model from the directory, its mean loss over the step's
    samples (all ranks' rows) with its own label shifting."""
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_hsdp.data.sampler import DatasetSamples
    from hpc_hsdp.data.tokens import open_dataset

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = torch.as_tensor(DatasetSamples(open_dataset(data_path), seq_len).read(np.asarray(sample_ids)))
    with torch.no_grad():
        return float(model(input_ids=rows, labels=rows).loss)


# ----------------------------------------------------------------------------- host memory of a pretrained load

MEDIUM_LLAMA = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def peak_rss_during(fn) -> tuple[int, float]:
    """(bytes the resident set grew to above its size before ``fn``, seconds): the kernel's
    high-water mark (VmHWM), reset first through /proc/self/clear_refs."""
    import gc
    import time

    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t0
    return (_status_kib("VmHWM") - before) * 1024, elapsed


def load_memory_report(ctx):
    """fn on every rank: the host memory a pretrained load adds to a rank, sharded (each rank
    reads its own rows) and naive (every rank reads the whole file)."""
    import torch
    from safetensors.torch import load_file

    from hpc_hsdp.models.hf import HFAdapter
    from hpc_hsdp.task.parallelism.hsdp import wrap_hsdp

    adapter = HFAdapter(ctx.spec.training)
    model = adapter.build_meta()
    wrap_hsdp(model, ctx.mesh, block=adapter.shard_units(model))
    model.to_empty(device="cpu")
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    sharded, sharded_s = peak_rss_during(lambda: adapter.load_pretrained(model))
    ctx.barrier()
    tokens = tokens_for(adapter.vocab_size)
    loss = float(adapter.loss(model, tokens[:, :-1], tokens[:, 1:]))
    plain = adapter.build_meta()
    plain.to_empty(device="cpu")

    def naive(module=plain):
        module.load_state_dict(load_file(str(adapter.weights_dir / "model.safetensors")), strict=False)

    naive_bytes, naive_s = peak_rss_during(naive)
    del plain, naive  # the naive copy's memory goes before the barrier
    torch.distributed.barrier()
    return {
        "rank": ctx.rank,
        "model_bytes": model_bytes,
        "sharded": sharded,
        "sharded_s": sharded_s,
        "naive": naive_bytes,
        "naive_s": naive_s,
        "loss": loss,
    }
