"""The errors and failure records the library raises or returns (no JAX, no other module of ours).

`PeerFailure` is what the host backend records when a half failed (`Communicator.last_error`);
`DroppedRowsError` is what debug=True raises when a dispatch drops or overflows."""

from __future__ import annotations


def shape_err(arg: str, expected, got) -> ValueError:
    """The ValueError of an argument with the wrong shape or dtype: "arg: expected X, got Y"."""
    return ValueError(f"{arg}: expected {expected}, got {got}")


class PeerFailure(str):
    """What the host backend recorded when a half failed: the text of the first failure (it is a
    str, so code that reads `last_error()` as text keeps working; also `.message`) and `missing`
    (sorted ranks that timed-out waits named, over this process's ranks and EP groups).
    `missing` is a hint, not the set of dead ranks: a survivor that failed earlier in the same
    step never sent what the others waited for, so it is named too."""

    def __new__(cls, message: str, missing):
        self = super().__new__(cls, message)
        self.missing = tuple(sorted(set(int(r) for r in missing)))
        return self

    @property
    def message(self) -> str:
        return str.__str__(self)

    def __repr__(self):
        return f"PeerFailure({self.message!r}, missing={self.missing})"


class DroppedRowsError(RuntimeError):
    """debug=True: a dispatch dropped pairs (bad expert ids), overflowed a receive buffer or was
    given a `num_tokens` above Spec.max_tokens_per_rank.

    The check runs inside the compiled step (a host callback), and JAX reports an exception
    raised there as `jax.errors.JaxRuntimeError` (INTERNAL), not as this class: Python has no
    way to make `except DroppedRowsError` match that error. Run the step inside
    `with comm.checked():`, which re-raises it as DroppedRowsError, or call `comm.check()`."""


def copy_of(err: BaseException) -> BaseException:
    """A new error with `err`'s message, to raise from a method: raising `err` itself would add
    the method's frame (and `self` in it) to the traceback of an object that logging records of
    the failed callback may keep (pytest's do), keeping the communicator alive with them."""
    return type(err)(*err.args)


__all__ = ["PeerFailure", "DroppedRowsError", "shape_err", "copy_of"]
