"""Find a model, build it inside the memory pool, and load (or reload) its weights by name."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from server.wire.tags import WEIGHTS
from server.model.config import ModelConfig
from server.model.llama import LlamaForCausalLM
from server.model.moe import HF_STACKED, SparseMoeBlock
from server.model.shard import Shard, TensorParallel

from server.wire.errors import WeightLoadError

if TYPE_CHECKING:
    from server.model.finite import FiniteCheck

log = logging.getLogger("sleepserve.model")


# Weights come in slabs of about this size, each one pool allocation (one physical handle on CUDA),
# every tensor a view of one: a sleep releases handles one by one, at 0.82 ms/GiB in 64 MiB handles
# and 0.33 ms/GiB from 1 GiB up (bench/vmm_floor.py, H200), and one allocation per tensor made an 8B
# model ~130 handles of ~120 MiB. A tensor larger than a slab gets one of its own.
SLAB_BYTES = 1 << 30
ALIGN = 512  # what torch's own allocator gives every tensor


def materialize(model: nn.Module, pool, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer real storage in the pool under tag `weights`.

    Projections that a module wants side by side (its fused_groups(): q|k|v, gate|up) get one
    tensor, and each projection's parameter is a view of it. Names stay those of the
    checkpoint, so loading and in-place updates are unchanged; on CUDA one GEMM serves the group.
    Every tensor is a view of one of a few slabs (SLAB_BYTES), in model order.
    """
    wanted: list[tuple[tuple[int, ...], torch.dtype, Callable[[torch.Tensor], None]]] = []
    grouped: set[int] = set()  # ids of the meta parameters a fused group places

    def group(module: nn.Module, name: str, kind: str, linears: list[nn.Linear], rows: list[int]):
        def place(whole: torch.Tensor) -> None:
            for lin, view in zip(linears, whole.split(rows)):
                lin._parameters[kind] = nn.Parameter(view, requires_grad=False)
            setattr(module, f"{name}_{kind}", whole)
        return place

    def param(module: nn.Module, name: str):
        def place(t: torch.Tensor) -> None:
            module._parameters[name] = nn.Parameter(t, requires_grad=False)
        return place

    def buffer(module: nn.Module, name: str):
        def place(t: torch.Tensor) -> None:
            module._buffers[name] = t
        return place

    for module in model.modules():
        groups = module.fused_groups() if hasattr(module, "fused_groups") else {}
        for name, linears in groups.items():
            for kind in ("weight", "bias"):
                parts = [getattr(lin, kind) for lin in linears]
                if any(p is None for p in parts):
                    continue
                rows = [p.shape[0] for p in parts]
                wanted.append(((sum(rows), *parts[0].shape[1:]), dtype, group(module, name, kind, linears, rows)))
                grouped.update(id(p) for p in parts)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta and id(p) not in grouped:
                wanted.append((tuple(p.shape), dtype, param(module, name)))
        for name, b in list(module._buffers.items()):
            if b is not None:
                wanted.append((tuple(b.shape), dtype if b.is_floating_point() else b.dtype, buffer(module, name)))
    views = _slab_views(pool, [(shape, dt) for shape, dt, _ in wanted])
    for (_, _, place), view in zip(wanted, views):
        place(view)


def _slab_views(pool, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of these shapes and dtypes, packed in order into slabs of about SLAB_BYTES (a larger
    tensor gets one of its own), each tensor starting on ALIGN bytes."""
    sizes = [math.prod(shape) * dt.itemsize for shape, dt in specs]
    places: list[tuple[int, int]] = []  # per tensor: (slab, offset)
    ends = [0]  # per slab: its bytes
    for size in sizes:
        start = -(-ends[-1] // ALIGN) * ALIGN
        if ends[-1] and start + size > SLAB_BYTES:
            ends.append(0)
            start = 0
        places.append((len(ends) - 1, start))
        ends[-1] = start + size
    slabs = [pool.empty((max(1, end),), torch.uint8, WEIGHTS) for end in ends]
    return [slabs[s][offset:offset + size].view(dt).view(shape)
            for (shape, dt), size, (s, offset) in zip(specs, sizes, places)]


def build_model(cfg: ModelConfig, pool, dtype: torch.dtype, max_positions: int,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, tp)
    materialize(model, pool, dtype)
    model.init_buffers()
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Reading checkpoints

def safetensors_files(path: Path) -> list[Path]:
    """The .safetensors files of a folder (sharded or not) or a single file. Any path a client may
    send (too long, not readable, a bad index) fails as WeightLoadError, never as an OSError."""
    try:
        return _safetensors_files(path)
    except WeightLoadError:
        raise
    except (OSError, ValueError) as e:  # too long, unreadable, an embedded NUL
        raise WeightLoadError(f"cannot read the path {_shown(path)}: {getattr(e, 'strerror', None) or e}") from None


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 200 else text[:100] + "..." + text[-40:])


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightLoadError(f"{_shown(path)} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise WeightLoadError(f"{_shown(path)} does not exist")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise WeightLoadError(f"{index} is not a valid safetensors index: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightLoadError(f"{index} is not a valid safetensors index: weight_map must map tensor names "
                                  "to shard file names")
        return [path / s for s in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{_shown(path)} holds no .safetensors files")
    return files


def _skip(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype string), read from the headers alone."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if not _skip(name):
                        sl = st.get_slice(name)
                        shapes[name] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightLoadError(f"could not read {f}: {e}") from None
    return shapes


def iter_checkpoint(files: list[Path], model: LlamaForCausalLM | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor; with a tensor-parallel model, only the slice its
    rank holds is read from the file (no rank reads the whole checkpoint)."""
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if _skip(name):
                        continue
                    shard = model.tp.shard(name) if model is not None else None
                    if shard is None:
                        yield name, st.get_tensor(name)
                        continue
                    sl = st.get_slice(name)
                    index = shard.index(len(sl.get_shape()))
                    # A stacked gate|up tensor's share is two ranges (shard.GateUpShard): cut from the whole.
                    yield name, shard.take(st.get_tensor(name)) if index is None else sl[index]
        except WeightLoadError:
            raise
        except Exception as e:
            raise WeightLoadError(f"could not read {f}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Copying weights into the model, in place

_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}


def _targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    return checkpoint_targets(model)


def checkpoint_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a checkpoint or a weight update may use -> the tensor it lands in (this rank's part).
    The parameters' own names, plus for each sparse layer (moe.py) the checkpoint's per-expert names,
    views of the stacked experts, and transformers 5's names of the stacks and the router (its
    in-memory model, which a trainer sends). Built once per model (the views never move)."""
    cached = getattr(model, "_checkpoint_targets", None)
    if cached is not None:
        return cached
    targets = {n: p for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            targets.update(module.experts.views(f"{name}.experts"))
            hf = name.rsplit(".", 1)[0] + ".mlp"  # transformers 5 calls every sparse MLP `mlp`
            targets.setdefault(f"{hf}.gate.weight", module.gate.weight)
            for hf_name, ours in HF_STACKED.items():
                targets[f"{hf}.experts.{hf_name}"] = getattr(module.experts, ours)
    model._checkpoint_targets = targets
    return targets


def _expert_units(model: nn.Module) -> dict[str, list[str]]:
    """A stacked expert tensor's names (ours and transformers 5's) -> the per-expert names it holds."""
    cached = getattr(model, "_expert_units", None)
    if cached is not None:
        return cached
    units: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock):
            hf = name.rsplit(".", 1)[0] + ".mlp"
            for hf_name, ours in HF_STACKED.items():
                held = module.experts.expert_names(f"{name}.experts", ours)
                units[f"{name}.experts.{ours}"] = units[f"{hf}.experts.{hf_name}"] = held
            if hf != name:
                units[f"{hf}.gate.weight"] = [f"{name}.gate.weight"]
    model._expert_units = units
    return units


def unit_names(model: nn.Module, names: Iterable[str]) -> set[str]:
    """What loading these names wrote, in the units parameter_names() counts: a stacked expert tensor
    is every per-expert name it holds (a model is whole once each expert is, however they were sent)."""
    units = _expert_units(model)
    out: set[str] = set()
    for name in names:
        out.update(units.get(name, (name,)))
    return out


def full_shape(model: LlamaForCausalLM, name: str, param: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint's shape of a parameter (its whole shape, whatever slice this rank holds)."""
    shard = model.tp.shard(name)
    return tuple(param.shape) if shard is None else shard.full_shape(tuple(param.shape))


def _alias(name: str, model: LlamaForCausalLM) -> str | None:
    """Checkpoints of tied models sometimes carry lm_head.weight too: it is the embedding, skip it."""
    if name == "lm_head.weight" and model.lm_head is None:
        return None
    return name


def check_checkpoint(model: LlamaForCausalLM, shapes: dict[str, tuple[tuple[int, ...], str]],
                     require_all: bool) -> None:
    """Reject a checkpoint that does not fit, naming every problem, before any byte is copied."""
    targets = _targets(model)
    problems: list[str] = []
    seen: set[str] = set()
    for name, (shape, dt) in shapes.items():
        target = _alias(name, model)
        if target is None:
            continue
        if target not in targets:
            problems.append(f"unexpected tensor {name!r}")
            continue
        seen.add(target)
        expected = full_shape(model, target, targets[target])
        if expected != tuple(shape):
            problems.append(f"{name}: shape {list(shape)} but the model has {list(expected)}")
        if dt not in _FLOAT_DTYPES:
            problems.append(f"{name}: dtype {dt} is not a floating-point type")
    if require_all:
        missing = sorted(parameter_names(model) - unit_names(model, seen))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(f"missing tensors: {', '.join(missing[:5])}{more}")
    if problems:
        raise WeightLoadError("the weights do not fit the served model: " + "; ".join(problems[:10]))


_TORCH_TO_ST = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}


def describe(named: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(t.shape), _TORCH_TO_ST.get(t.dtype, str(t.dtype))) for n, t in named.items()}


@torch.no_grad()
def copy_weights(model: LlamaForCausalLM, named: Iterable[tuple[str, torch.Tensor]], sliced: bool = False,
                 check: "FiniteCheck | None" = None) -> set[str]:
    """Copy checked tensors into the existing parameters (addresses unchanged). Returns the names set.
    Tensors are whole checkpoint tensors, or (sliced, from iter_checkpoint(files, model)) this rank's slices.
    check: each parameter written is added to it as it lands (finite.py); the caller verifies it."""
    targets = _targets(model)
    loaded: set[str] = set()
    for name, tensor in named:
        target = _alias(name, model)
        if target is None:
            continue
        shard = model.tp.shard(target)
        if shard is None:
            targets[target].copy_(tensor)
        else:
            shard.place(targets[target], tensor if sliced else shard.take(tensor))
        if check is not None:
            check.add(target, targets[target])
        loaded.add(target)
    model.init_buffers()
    return unit_names(model, loaded)


def load_checkpoint(model: LlamaForCausalLM, path: Path) -> set[str]:
    files = safetensors_files(path)
    check_checkpoint(model, checkpoint_shapes(files), require_all=True)
    return copy_weights(model, iter_checkpoint(files, model), sliced=True)


@torch.no_grad()
def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of a realistic scale, for benchmarks of sizes that cannot be downloaded here.
    A tensor-parallel rank draws each whole tensor and keeps its slice, so every world size serves
    the same model (one whole tensor at a time on the device: the embedding of 8B is 1 GiB)."""
    gen = torch.Generator(device=model.output_weight().device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            shard: Shard | None = model.tp.shard(name)
            if shard is None:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                whole = torch.empty(shard.full_shape(tuple(p.shape)), dtype=p.dtype, device=p.device)
                shard.place(p, shard.take(whole.normal_(0.0, 0.02, generator=gen)))
                del whole
    model.init_buffers()


def receiver_names(model: nn.Module) -> tuple[dict[str, torch.Tensor], Callable[[Iterable[str]], set[str]]]:
    """What a weight-transfer receiver takes: the names a trainer may send (checkpoint_targets) and how its
    writes count (unit_names)."""
    return checkpoint_targets(model), lambda names: unit_names(model, names)


def parameter_names(model: nn.Module) -> set[str]:
    """The names a complete load covers: every parameter's, a sparse layer's experts by their
    per-expert checkpoint names (unit_names maps the stacked names onto them)."""
    cached = getattr(model, "_parameter_names", None)
    if cached is None:
        cached = unit_names(model, (n for n, _ in model.named_parameters()))
        model._parameter_names = cached
    return cached
