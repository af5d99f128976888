"""Drafter checkpoints bound to their target (DESIGN.md §1.1: layer ids stored, never guessed).

A checkpoint is a directory::

    <path>/drafter.json   format version, DrafterConfig, the target binding, the target's
                          ModelConfig, the parameter dtype, the sha256 of every file under
                          params/, and the trainer's ``training`` dict
    <path>/params/        the drafter's ``nnx.state`` as a pure dict, written by Orbax

A drafter is only meaningful next to the target whose features, embedding and LM head it was
trained on, so the binding (family, vocabulary, width, layer count, weights sha256) is checked on
load; so are the parameter files' sha256, before Orbax reads them, so flipped, truncated or
missing bytes are named instead of decoding silently with damaged weights (format 1 checkpoints,
written before the checksums, load with a warning). Saving builds the directory under a hidden temporary sibling and moves it into place with
``os.replace``, so ``<path>`` either holds a complete checkpoint or does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from treespark_jax.config import DrafterConfig, ModelConfig
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.files import sha256_files, write_dir_atomic
from treespark_jax.models.presets import PRESETS

if TYPE_CHECKING:
    from treespark_jax.models.load import Target

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: drafter.json records the sha256 of every parameter file
READ_VERSIONS = (1, 2)
_SHAPE_FIELDS = ("family", "vocab_size", "d_model", "n_layers")  # a mismatch can never load


def _first_difference(a, b, fields: tuple[str, ...]) -> str | None:
    return next((f for f in fields if getattr(a, f) != getattr(b, f)), None)


def weights_sha256(path: Path) -> str:
    """Lowercase hex sha256 of a target's weights.

    For a file (GGUF), the sha256 of its bytes. For a Hugging Face directory, the sha256 of the
    concatenated bytes of every ``*.safetensors`` file directly inside it, taken in sorted file-name
    order (the names themselves are not hashed). Files are streamed in 1 MiB chunks.

    Raises:
      ValueError: a directory without ``*.safetensors`` files.
    """
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"directory {str(path)!r} has no *.safetensors files to hash.")
    return sha256_files(files)


def target_sha256(name: str) -> str:
    """The weights hash ``TargetBinding.of`` records for the target ``name`` (a preset's pinned
    sha256, else ``weights_sha256`` of the file or directory), without loading it.

    Raises:
      ValueError: a directory without ``*.safetensors`` files.
      FileNotFoundError: a path that does not exist.
    """
    return PRESETS[name].asset.sha256 if name in PRESETS else weights_sha256(Path(name))


def params_sha256(params: Path) -> dict[str, str]:
    """The sha256 of every file under a checkpoint's ``params`` directory, keyed by its POSIX path
    relative to that directory."""
    return {f.relative_to(params).as_posix(): sha256_files([f]) for f in sorted(params.rglob("*")) if f.is_file()}


@dataclasses.dataclass(frozen=True)
class TargetBinding:
    """The target a drafter was trained for.

    Attributes:
      name: preset name, or the resolved path of the GGUF file / Hugging Face directory
        (reported in messages, never compared: a moved file is the same target).
      family, vocab_size, d_model, n_layers: the target's architecture (V, D, L).
      weights_sha256: hex sha256 of the weights (see ``weights_sha256``).
    """

    name: str
    family: str
    vocab_size: int
    d_model: int
    n_layers: int
    weights_sha256: str

    @classmethod
    def of(cls, target: Target) -> TargetBinding:
        """The binding of a loaded target; a preset uses its pinned sha256 (checked at fetch),
        a path is hashed here (seconds per GB)."""
        name = target.name if target.name in PRESETS else str(Path(target.path).resolve())
        return cls.for_config(target.cfg, name, target_sha256(name))

    @classmethod
    def for_config(cls, cfg: ModelConfig, name: str, sha256: str) -> TargetBinding:
        """A binding from an architecture and a given weights hash (tests, in-memory targets)."""
        return cls(name, cfg.family, cfg.vocab_size, cfg.d_model, cfg.n_layers, sha256)

    def describe(self) -> str:
        return (f"{self.family}, vocab {self.vocab_size}, width {self.d_model}, {self.n_layers} layers, "
                f"sha256 {self.weights_sha256[:12]}…")


@dataclasses.dataclass(frozen=True)
class DrafterMeta:
    """What ``drafter.json`` records besides the parameters.

    Attributes:
      cfg: the drafter architecture (``target_layer_ids`` included).
      binding: the target it was trained for.
      target_cfg: that target's full architecture (the drafter layers copy its shapes).
      dtype: parameter dtype name at save time, e.g. ``"float32"``.
      training: the trainer's dict (loss name, config, final losses), verbatim, or ``None``.
      params_sha256: ``params_sha256`` of the parameter files at save time; ``None`` in a
        format 1 checkpoint, which predates it.
    """

    cfg: DrafterConfig
    binding: TargetBinding
    target_cfg: ModelConfig
    dtype: str
    training: dict | None
    params_sha256: dict[str, str] | None = None


def _writer() -> ocp.StandardCheckpointer:
    """An Orbax checkpointer for this process alone: in a multi-host job one process writes the
    drafter, and the default checkpointer would wait for the others at its barriers."""
    if jax.process_count() == 1:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    return ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"drafter_{me}"))


def save_drafter(path: str | Path, drafter: BlockDrafter, binding: TargetBinding, *,
                 training: dict | None = None, overwrite: bool = False) -> Path:
    """Writes ``drafter`` and its metadata to the directory ``path``, atomically.

    Args:
      path: checkpoint directory to create (its parent is created if needed).
      drafter: the drafter; its parameters are saved in their own dtype.
      binding: the target it was trained for; must agree with ``drafter.target_cfg``.
      training: any JSON-serialisable dict, stored verbatim (loss name, config, final losses).
      overwrite: replace an existing ``path`` (the old one is removed only after the new one is
        in place; a crash between the two moves can leave neither, plus a hidden ``.old``).

    Returns:
      The absolute checkpoint path.

    Raises:
      ValueError: ``path`` exists and ``overwrite`` is False, ``binding`` contradicts the
        drafter's target config, or ``training`` is not JSON-serialisable.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise ValueError(f"{path} already exists; pass overwrite=True to replace it.")
    if field := _first_difference(binding, drafter.target_cfg, _SHAPE_FIELDS):
        raise ValueError(f"binding {field}={getattr(binding, field)} contradicts the drafter's target "
                         f"config ({getattr(drafter.target_cfg, field)}).")
    meta = {"format_version": FORMAT_VERSION, "drafter": dataclasses.asdict(drafter.cfg),
            "target": dataclasses.asdict(binding), "target_config": dataclasses.asdict(drafter.target_cfg),
            "dtype": jnp.dtype(drafter.dtype).name, "training": training}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the training dict is not JSON-serialisable ({e}).") from e

    def write(tmp: Path) -> None:
        with _writer() as ckptr:
            ckptr.save(tmp / "params", nnx.to_pure_dict(nnx.state(drafter)))
            ckptr.wait_until_finished()
        meta["params_sha256"] = params_sha256(tmp / "params")
        (tmp / "drafter.json").write_text(json.dumps(meta, indent=2))  # last: without it, incomplete

    return write_dir_atomic(path, write)


def read_meta(path: str | Path) -> DrafterMeta:
    """Reads ``drafter.json`` of the checkpoint at ``path``.

    Raises:
      ValueError: no such directory, no ``drafter.json``, unreadable JSON, an unknown format
        version, or fields that do not make a valid config (each naming ``path``).
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"drafter checkpoint {path} does not exist or is not a directory.")
    try:
        meta = json.loads((path / "drafter.json").read_text())
    except FileNotFoundError:
        inside = sorted(d.name for d in path.iterdir() if (d / "drafter.json").is_file())
        hint = f"; it holds the drafters {', '.join(inside)}: pass one of them" if inside else ""
        raise ValueError(f"drafter checkpoint {path} has no drafter.json (incomplete or not a drafter){hint}."
                         ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"drafter checkpoint {path} has a corrupt drafter.json ({e}).") from e
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in READ_VERSIONS:
        raise ValueError(f"drafter checkpoint {path} has format version {version!r}; this version reads "
                         f"{' and '.join(map(str, READ_VERSIONS))}.")
    try:
        digests = meta["params_sha256"] if version >= 2 else None
        if version >= 2 and not (isinstance(digests, dict) and digests
                                 and all(isinstance(v, str) for v in digests.values())):
            raise ValueError("params_sha256 is not a mapping of file names to sha256 strings")
        return DrafterMeta(cfg=DrafterConfig(**meta["drafter"]), binding=TargetBinding(**meta["target"]),
                           target_cfg=ModelConfig(**meta["target_config"]),
                           dtype=jnp.dtype(meta["dtype"]).name,
                           training=meta.get("training"), params_sha256=digests)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"drafter checkpoint {path} has an invalid drafter.json "
                         f"({type(e).__name__}: {e}).") from e


def _check_params(path: Path, digests: dict[str, str] | None) -> None:
    """Compares the parameter files with the sha256 ``drafter.json`` records (before Orbax reads
    them: a damaged file is named here, not deep inside TensorStore)."""
    if digests is None:
        logger.warning("drafter checkpoint %s (format 1) records no checksums of its parameters; "
                       "damaged files cannot be detected (re-save it to add them).", path)
        return
    found = params_sha256(path / "params") if (path / "params").is_dir() else {}
    for name in sorted(set(digests) | set(found)):  # every file, listed or not, must match its record
        if name not in found:
            raise ValueError(f"drafter checkpoint {path} is missing its parameter file params/{name}.")
        if found[name] != digests.get(name):
            raise ValueError(f"drafter checkpoint {path} is corrupt: params/{name} does not match the sha256 "
                             "recorded in drafter.json (copy or train it again).")


def _check_binding(saved: TargetBinding, given: TargetBinding, path: Path, strict: bool) -> None:
    fields = _SHAPE_FIELDS + (("weights_sha256",) if strict else ())
    if field := _first_difference(saved, given, fields):
        hint = "; pass strict=False to load it anyway" if field == "weights_sha256" else ""
        raise ValueError(f"drafter {path} was trained for target {saved.name!r} ({saved.describe()}) but the "
                         f"given target {given.name!r} ({given.describe()}) differs in {field} "
                         f"({getattr(saved, field)} vs {getattr(given, field)}){hint}.")


def load_drafter(path: str | Path, target: Target | TargetBinding, *, dtype=None, strict: bool = True
                 ) -> tuple[BlockDrafter, DrafterMeta]:
    """Loads a drafter saved by ``save_drafter`` after checking it was trained for ``target``.

    Args:
      path: checkpoint directory.
      target: the loaded target (its binding is computed with ``TargetBinding.of``) or a binding.
      dtype: parameter dtype to restore into (Orbax casts); ``None`` keeps the saved dtype.
      strict: also require the same weights sha256. Family, vocabulary, width and layer count must
        always agree; ``strict=False`` accepts other weights of the same architecture (another
        fine-tune or quantisation), where the drafter runs but may accept fewer drafts.

    Returns:
      ``(drafter, meta)``; the drafter is built from the stored configs (layer ids from the file).

    Raises:
      ValueError: any ``read_meta`` error, a binding mismatch (naming the field and both values),
        a parameter file missing or unlike its recorded sha256, or parameters Orbax cannot
        restore into the drafter's shapes.
    """
    path = Path(path).absolute()
    meta = read_meta(path)
    given = target if isinstance(target, TargetBinding) else TargetBinding.of(target)
    _check_binding(meta.binding, given, path, strict)
    _check_params(path, meta.params_sha256)
    dtype = getattr(jnp, meta.dtype) if dtype is None else dtype  # jnp.float32, as elsewhere
    abstract = nnx.eval_shape(lambda: BlockDrafter(meta.cfg, meta.target_cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    try:  # Orbax and TensorStore raise many exception types for a damaged directory
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path / "params", nnx.to_pure_dict(state))
    except Exception as e:  # noqa: BLE001
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"drafter checkpoint {path} has missing or corrupt parameters ({reason}).") from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state), meta


def warm_start(drafter: BlockDrafter, source: BlockDrafter) -> int:
    """Copies into ``drafter`` every parameter ``source`` has at the same path with the same shape.

    Used to start a drafter of another recipe from a trained one (a ``treespark`` drafter with an
    edge head from a ``dspark`` one with a confidence head): the backbone and shared heads carry
    over, parameters ``source`` lacks keep their fresh initialisation. A deeper drafter started from
    a shallower one gets the source's layers first, and each decoder layer past them starts as the
    identity: its fresh weights kept but its two output projections (``wo``, ``w_down``) zeroed, so
    both residual branches add 0 and the drafter starts as the source's function, from which training
    grows the new layer (function-preserving depth growth: Chen, Goodfellow and Shlens, "Net2Net",
    ICLR 2016, whose identity layers are replaced here by zeroed residual branches).

    Returns:
      The number of parameter arrays copied.
    """
    fresh = nnx.to_flat_state(nnx.state(drafter))
    loaded = dict(nnx.to_flat_state(nnx.state(source)))
    keep = [(k, loaded[k] if k in loaded and loaded[k].shape == v.shape else v) for k, v in fresh]
    nnx.update(drafter, nnx.from_flat_state(keep))
    for layer in drafter.layers[len(source.layers):]:
        for name in ("wo", "w_down"):
            getattr(layer, name)[...] = jnp.zeros_like(getattr(layer, name)[...])
    return sum(k in loaded and loaded[k].shape == v.shape for k, v in fresh)


def export_drafter(src: str | Path, dst: str | Path, dtype: str = "bfloat16", *, draft_vocab=None,
                   overwrite: bool = False) -> Path:
    """Copies the drafter at ``src`` to ``dst`` with parameters stored in ``dtype`` (e.g. the
    bfloat16 checkpoints shipped in ``treespark_jax/drafters``: half the bytes; loading casts
    back to the compute dtype), optionally with a draft vocabulary. Binding and training
    record are kept.

    Args:
      src, dst: checkpoint directories.
      dtype: storage dtype of the copy.
      draft_vocab: ``[U]`` token ids the copy drafts from (``BlockDrafter.with_draft_vocab``),
        e.g. ``train.draft_vocab.frequency_ranked_vocab``; ``None`` keeps the source's.
      overwrite: replace an existing ``dst``.

    Raises:
      ValueError: as ``read_meta`` / ``load_drafter`` for ``src``, as ``save_drafter`` for
        ``dst``, as ``BlockDrafter.set_draft_vocab`` for ``draft_vocab``.
    """
    meta = read_meta(src)
    drafter, _ = load_drafter(src, meta.binding, dtype=jnp.dtype(dtype))
    if draft_vocab is not None:
        drafter = drafter.with_draft_vocab(draft_vocab)
    return save_drafter(dst, drafter, meta.binding, training=meta.training, overwrite=overwrite)
