"""Running the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

One compatibility shim: the interpreter turns a loaded scalar into a Python int (a loop bound
read from a tensor, ``range(lo, hi, BLOCK)``) with ``int(array)``, and its scalars are 1-element
arrays, which NumPy 2.x no longer converts. The shim reads the element instead. It changes only
the interpreter; compiled kernels never see it.
"""

from __future__ import annotations

_applied = False


def apply() -> None:
    """Install the shim once (only when interpreting; the kernels' modules call it first)."""
    global _applied
    if _applied:
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))  # type: ignore[attr-defined]

    interpreter._patch_lang_tensor = patched
    _applied = True
