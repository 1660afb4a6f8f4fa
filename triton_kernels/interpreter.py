"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), made cheaper for the tests and the GPU check's dry run.

The interpreter runs a kernel's body in Python over NumPy blocks, and spends most of its time on its own
bookkeeping, not on the arithmetic:

* :func:`speed_up` changes two of its habits that redo work without changing what a kernel computes:
  listing every member of the language's modules at every launch and nested call to find the builtins
  (a tenth of the time), and patching the language again at every call of a nested ``@triton.jit``
  function, over the launch's own patches and with the same wrappers (two fifths of a kernel that calls
  helpers in its loops);
* it also stops computing int32 overflow checks that nothing reads: by default (``sanitize_overflow``) the
  interpreter does every integer add, subtract and multiply again in int64 and compares it against the
  int32 range, two fifths of the interpreted time, and then drops the comparison, because its assertions
  act only with ``debug=True``, which it never sets (Triton 3.7);
* :func:`overflow_checks` makes the checks real inside a block: computed and asserted (``debug=True``).

Each leaves an interpreter of another shape (another Triton) as it is. Nothing here imports Triton until it
is called, and nothing runs without the interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from collections.abc import Iterator


def _interpreter():
    """Triton's interpreter module, when kernels run on it."""
    if os.environ.get("TRITON_INTERPRET", "") != "1":
        return None
    from triton.runtime import interpreter

    return interpreter


def speed_up() -> None:
    """Lists the language's builtins once, and patches the language once per launch. Idempotent."""
    interpreter = _interpreter()
    if interpreter is None or getattr(interpreter, "_spectral_ops_sped_up", False):
        return
    _list_the_language_once(interpreter)
    _patch_the_language_once_per_launch(interpreter)
    _set_checks(interpreter, False)
    interpreter._spectral_ops_sped_up = True


def _list_the_language_once(interpreter) -> None:
    """The builtins are fixed once the language is imported: listed at the first launch, as the interpreter
    lists them there, and kept; the patching itself is the interpreter's."""
    import triton.language as tl

    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if patch_builtin is None or patch_attr is None or \
            list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return
    builtins = {}

    def patch_listed_builtins(pkg, builder, scope):
        if pkg not in builtins:
            builtins[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name, member in builtins[pkg]:
            patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_listed_builtins


def _patch_the_language_once_per_launch(interpreter) -> None:
    """A nested function's call patches only when it sees a language module the launch has not patched; a
    launch still patches when it starts and restores when it ends (its ``finally``)."""
    import triton.language as tl

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or list(inspect.signature(patch_lang).parameters) != ["fn"] or \
            not hasattr(interpreter, "_LangPatchScope"):
        return
    launch = []  # while a launch runs: the ids of the language modules it patched
    # A module's language imports, by its globals (kept: a kernel module lives as long as the process), found
    # once: scanning every global at every nested call was a twentieth of a composed path's time.
    languages_of = {}

    def patch_lang_unless_patched(fn):
        module_globals = fn.__globals__
        if id(module_globals) not in languages_of:
            languages_of[id(module_globals)] = (module_globals, frozenset(
                id(value) for value in module_globals.values() if inspect.ismodule(value) and value in (tl, tl.core)))
        languages = languages_of[id(module_globals)][1]
        if launch and languages <= launch[0]:
            return interpreter._LangPatchScope()  # patched already: nothing to restore
        scope = patch_lang(fn)
        if launch:  # a nested function that sees another module: it stays patched, as the interpreter leaves it
            launch[0] |= languages
            return scope
        launch.append(set(languages))
        restore = scope.restore

        def restore_and_end_the_launch():
            launch.clear()
            restore()

        scope.restore = restore_and_end_the_launch
        return scope

    interpreter._patch_lang = patch_lang_unless_patched


def _set_checks(interpreter, enabled: bool):
    """Sets the overflow checks and the assertions together; returns the options they replaced, or None
    where the interpreter has no such options."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not (hasattr(options, "sanitize_overflow") and hasattr(options, "debug")):
        return None
    builder.options = dataclasses.replace(options, sanitize_overflow=enabled, debug=enabled)
    return options


@contextlib.contextmanager
def overflow_checks() -> Iterator[None]:
    """Inside the block, every integer add, subtract and multiply of a kernel is checked for int32 overflow,
    and a kernel's assertions hold (an ``InterpreterError`` naming the failed one)."""
    interpreter = _interpreter()
    options = _set_checks(interpreter, True)
    try:
        yield
    finally:
        if options is not None:
            interpreter.interpreter_builder.options = options
