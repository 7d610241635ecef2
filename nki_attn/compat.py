"""Stand in for the ``flash_attn`` package, so code written for FlashAttention runs unchanged on nki-attn.

    import nki_attn.compat
    nki_attn.compat.install_as_flash_attn()
    from flash_attn import flash_attn_func          # now nki_attn.flash_attn_func
    ...
    nki_attn.compat.uninstall_flash_attn()          # back to how it was

``install_as_flash_attn()`` registers two modules in ``sys.modules``: ``flash_attn`` and
``flash_attn.flash_attn_interface`` (the module FlashAttention's own tests and several libraries import from).
Both expose FlashAttention 2's six attention functions, which are ours (same signatures, same tensors
``[batch, seqlen, heads, head_dim]``), and ``flash_attn_with_kvcache``, which is not implemented here and raises
``NotImplementedError`` when called (it exists so that import lines naming it keep working). Nothing else of
FlashAttention's package is provided (``bert_padding``, ``layers``, ``modules``, ``ops``): importing those still
fails with ``ModuleNotFoundError``.

It is opt-in (nothing happens on ``import nki_attn``) and reversible. It refuses (``RuntimeError``) when the real
FlashAttention package is importable, because then ``import flash_attn`` already means something and silently
replacing it would change which kernels another part of the program runs; ``force=True`` replaces it anyway, and
``uninstall_flash_attn()`` puts the real modules back if they had been imported.

The stand-in modules carry no ``__version__`` and no distribution metadata, so libraries that probe for an
installed FlashAttention by its package metadata (Hugging Face transformers does) do not mistake them for the CUDA
package.
"""
import importlib.machinery
import importlib.util
import sys
import types

PACKAGE = "flash_attn"
INTERFACE = "flash_attn.flash_attn_interface"
FUNCTIONS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
             "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func")

# What sys.modules held under our names before install_as_flash_attn(force=True) replaced it.
_saved = {}


def flash_attn_with_kvcache(*args, **kwargs):
    """FlashAttention's decoding entry point (attention against a KV cache, appending new keys in place).

    Not implemented by nki-attn: raises ``NotImplementedError``. It is exported so that
    ``from flash_attn import ..., flash_attn_with_kvcache`` keeps importing; the training functions
    (``flash_attn_func`` and the others) are the supported ones.
    """
    raise NotImplementedError(
        "flash_attn_with_kvcache is not implemented by nki-attn (it provides FlashAttention's training functions: "
        + ", ".join(FUNCTIONS) + "); for a cache, concatenate the keys yourself and call flash_attn_func with "
        "causal=True, which aligns queries to the end of the keys as FlashAttention does")


def is_installed():
    """True when ``flash_attn`` in ``sys.modules`` is this module's stand-in."""
    return getattr(sys.modules.get(PACKAGE), "__nki_attn_compat__", False)


def real_flash_attn_available():
    """True when a real FlashAttention package is imported or importable (the stand-in does not count)."""
    mod = sys.modules.get(PACKAGE)
    if mod is not None:
        return not getattr(mod, "__nki_attn_compat__", False)
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def _module(name, doc, is_package):
    mod = types.ModuleType(name, doc)
    # A spec makes importlib.util.find_spec(name) answer (it raises ValueError for a module without one).
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        mod.__path__ = []
        mod.__spec__.submodule_search_locations = []
    mod.__nki_attn_compat__ = True
    return mod


def install_as_flash_attn(force=False):
    """Make ``import flash_attn`` and ``from flash_attn[.flash_attn_interface] import flash_attn_func, ...``
    resolve to nki-attn's functions, until ``uninstall_flash_attn()``.

    Args:
        force: replace a real FlashAttention package too (without it, that is refused).

    Returns:
        The ``flash_attn`` stand-in module. Calling it again while installed returns the same module.

    Raises:
        RuntimeError: the real ``flash_attn`` is importable and ``force`` is False.
    """
    if is_installed():
        return sys.modules[PACKAGE]
    if real_flash_attn_available() and not force:
        where = getattr(sys.modules.get(PACKAGE), "__file__", None)
        if where is None:
            spec = importlib.util.find_spec(PACKAGE)
            where = getattr(spec, "origin", None) or "an installed package"
        raise RuntimeError(
            f"install_as_flash_attn: the real FlashAttention package is installed ({where}); replacing it would "
            "change which kernels the rest of the program runs. Call install_as_flash_attn(force=True) to replace "
            "it anyway (uninstall_flash_attn() restores it), or import nki_attn's functions directly "
            "(from nki_attn import flash_attn_func).")
    from . import attention

    _saved.clear()
    for name in list(sys.modules):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            _saved[name] = sys.modules.pop(name)

    iface = _module(INTERFACE, "nki-attn's implementation of FlashAttention 2's flash_attn_interface.", False)
    pkg = _module(PACKAGE, "nki-attn standing in for FlashAttention (installed by "
                           "nki_attn.compat.install_as_flash_attn).", True)
    for mod in (iface, pkg):
        for name in FUNCTIONS:
            setattr(mod, name, getattr(attention, name))
        mod.flash_attn_with_kvcache = flash_attn_with_kvcache
        mod.__all__ = list(FUNCTIONS) + ["flash_attn_with_kvcache"]
    pkg.flash_attn_interface = iface
    sys.modules[PACKAGE] = pkg
    sys.modules[INTERFACE] = iface
    return pkg


def uninstall_flash_attn():
    """Undo ``install_as_flash_attn()``: remove the stand-in modules from ``sys.modules`` and put back the real
    ones it replaced, if any had been imported. Returns True when something was uninstalled. Names already
    bound by ``from flash_attn import ...`` keep pointing to nki-attn's functions."""
    if not is_installed():
        return False
    for name in (INTERFACE, PACKAGE):
        sys.modules.pop(name, None)
    sys.modules.update(_saved)
    _saved.clear()
    return True


__all__ = ["install_as_flash_attn", "uninstall_flash_attn", "is_installed", "real_flash_attn_available",
           "flash_attn_with_kvcache"]
