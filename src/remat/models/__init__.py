"""Built-in models, transformers models (``hf:<model_type>``), ``package.module:factory``
and ``path/to/file.py:factory``.

A model factory takes keyword-only options and returns ``(model, example_batch, loss_fn)``,
where ``loss_fn(model, batch)`` runs the forward pass and returns a scalar loss.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

import remat.models.convnet_bn as convnet_bn
import remat.models.convnext as convnext
import remat.models.encdec as encdec
import remat.models.gpt as gpt
import remat.models.hf as hf
import remat.models.mlp_hetero as mlp_hetero
import remat.models.resnet as resnet
import remat.models.unet as unet
import remat.models.vision as vision
from remat.core.errors import UsageError, UserCodeError

# Import the submodules (not their factories) so remat.models.gpt stays the module.
BUILTINS: dict[str, Callable[..., Any]] = {
    "gpt": gpt.gpt,
    "mlp-hetero": mlp_hetero.mlp_hetero,
    "convnet-bn": convnet_bn.convnet_bn,
    "resnet": resnet.resnet,
    "convnext": convnext.convnext,
    "encdec": encdec.encdec,
    "unet": unet.unet,
    "mobilenet": vision.mobilenet,
    "efficientnet": vision.efficientnet,
    "vgg": vision.vgg,
}
DEFAULT_MODEL = "gpt"

__all__ = ["BUILTINS", "DEFAULT_MODEL", "load_model", "parse_set_options"]

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _import_file(path: Path) -> ModuleType:
    """The Python file ``path`` as a module (``my_model.py`` of ``my_model.py:factory``)."""
    if not path.is_file():
        raise UsageError(f"model file {str(path)!r} does not exist; give the path of the .py "
                         "file that defines the factory")
    name = f"remat_model_{zlib.crc32(str(path.resolve()).encode()):08x}_{path.stem}"
    if name in sys.modules:  # the same file again: one module, as with an import
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # so that its classes pickle and dataclasses resolve
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise  # the user's own code: the command names it (loading the model, exit 3)
    return module


def _resolve(spec: str) -> Callable[..., Any]:
    """Find the factory a spec names: a built-in, ``hf:<model_type>``, ``package.module:attr``
    or ``path/to/file.py:attr``."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    if spec.startswith(hf.PREFIX):
        return hf.hf_factory(spec)
    choices = ", ".join([*BUILTINS, *(hf.PREFIX + name for name in hf.FAMILIES)])
    # path/to/file.py:factory keeps any colon of the path before the .py; everything else
    # has one colon at most
    after = spec.rpartition(".py:")[2] if ".py:" in spec else spec.partition(":")[2]
    if ":" in after:
        raise UsageError(
            f"model spec {spec!r} has too many colons; write it as path/to/file.py:factory or "
            "package.module:factory (one colon before the factory's name)"
        )
    module_name, sep, attr = spec.rpartition(":") if ".py:" in spec else spec.partition(":")
    if not sep:
        raise UsageError(
            f"unknown model {spec!r}; choose one of {choices} or give package.module:factory "
            "or path/to/file.py:factory"
        )
    if not module_name or not attr:
        raise UsageError(f"model spec {spec!r} is incomplete; write it as package.module:factory")
    if module_name.endswith(".py"):
        module = _import_file(Path(module_name))
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise UsageError(
                f"cannot import module {module_name!r} from model spec {spec!r} ({err}); "
                "check the name and that its directory is on PYTHONPATH, or give the file "
                "as path/to/file.py:factory"
            ) from err
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise UsageError(
                f"module {module_name!r} has no attribute {attr!r}; check the name after ':'"
            ) from err
    if not callable(obj):
        raise UsageError(
            f"{spec!r} is not callable (it is of type {type(obj).__name__}); "
            "point it at a model factory function"
        )
    return obj


def _check_options(spec: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Raise UsageError if ``factory`` cannot take ``options`` as keyword arguments."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no signature to check against (e.g. a C callable); let the call decide
    try:
        sig.bind(**options)
    except TypeError as err:
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        unknown = [k for k in options if k not in sig.parameters]
        if unknown:
            raise UsageError(
                f"model {spec!r} has no option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; "
                f"its options are {', '.join(accepted) or 'none'}"
            ) from err
        raise UsageError(
            f"cannot call model factory {spec!r} with these options ({err}); "
            "give it keyword-only options"
        ) from err


def load_model(spec: str, **options: Any) -> tuple[nn.Module, Any, Callable[..., Any]]:
    """Build a model from a built-in name, ``hf:<model_type>``, ``package.module:factory``
    or ``path/to/file.py:factory``.

    Returns ``(model, example_batch, loss_fn)``; raises UsageError for a spec or option
    the user can fix, UserCodeError for a factory that returns the wrong thing.
    """
    factory = _resolve(spec)
    _check_options(spec, factory, options)
    if spec in BUILTINS or spec.startswith(hf.PREFIX):
        try:
            result = factory(**options)
        except (MemoryError, RuntimeError) as err:
            if not _out_of_memory(err):
                raise
            raise UsageError(_too_large(spec, options, err)) from err
    else:
        result = factory(**options)
    if not (isinstance(result, tuple) and len(result) == 3):
        got = (
            f"a {len(result)}-tuple"
            if isinstance(result, tuple)
            else f"an object of type {type(result).__name__}"
        )
        raise UserCodeError(
            f"model factory {spec!r} returned {got}; it must return (model, example_batch, loss_fn)"
        )
    model, batch, loss_fn = result
    if not isinstance(model, nn.Module):
        raise UserCodeError(
            f"model factory {spec!r} returned an object of type {type(model).__name__} "
            "as the model; the first item must be a torch.nn.Module"
        )
    if not callable(loss_fn):
        raise UserCodeError(
            f"model factory {spec!r} returned an object of type {type(loss_fn).__name__} "
            "as loss_fn; the third item must be callable as loss_fn(model, batch)"
        )
    return model, batch, loss_fn


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the allocator refusing a tensor (torch's own and Python's)."""
    text = str(err).lower()
    return isinstance(err, MemoryError) or any(
        words in text for words in ("can't allocate memory", "out of memory",
                                    "cannot allocate memory", "not enough memory"))


def _too_large(spec: str, options: dict[str, Any], err: BaseException) -> str:
    """One sentence for a built-in model whose options make it too large to build."""
    said = str(err).strip().splitlines()
    first = said[0] if said else ""
    first = first[first.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in first \
        else first
    cause = f"{type(err).__name__}: {first[:200]}".rstrip(": ")
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    what = f"--set {given}" if given else "its default options"
    return (f"{what} makes the built-in model {spec!r} too large to build in this machine's "
            f"memory ({cause}); give a smaller value")


def _parse_value(text: str) -> bool | int | float | str:
    """Read ``true``/``false`` as bool, then try int, then float, else keep the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_set_options(items: list[str]) -> dict[str, Any]:
    """Turn ``["n_layer=4", "dropout=0.0", "flag=true", "name=x"]`` into typed options.

    Values become bool (``true``/``false``), int, float or else str; dashes in keys become
    underscores; a key given twice is a UsageError (which one was meant?).
    """
    options: dict[str, Any] = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not _KEY_RE.match(key):
            raise UsageError(f"--set {item!r} is not key=value; write it like --set n_layer=4")
        if key in options:
            raise UsageError(
                f"--set names {key!r} twice ({given[key]!r} and {item!r}); give each option "
                "once"
            )
        options[key], given[key] = _parse_value(value), item
    return options
