"""What a rematerialization pass changed, per scan pair and per unrolled layer, and the
plan notes that say so (`autopar.passes.remat`)."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import format_bytes
from autopar.passes.remat_unrolled import LayerRemat


@dataclass(frozen=True)
class PairRemat:
    """One forward/backward scan pair, before and after `remat`."""

    forward: str  # the forward scan's key (source line and name stack)
    backward: str
    layers: int  # the loop length
    residuals_before: int  # stored per-layer values the backward reads
    residuals_after: int
    bytes_before: int  # all layers
    bytes_after: int
    recompute_flops: float  # backward FLOPs added per call (all layers)

    @property
    def bytes_per_layer_before(self) -> int:
        return self.bytes_before // self.layers

    @property
    def bytes_per_layer_after(self) -> int:
        return self.bytes_after // self.layers

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after


@dataclass(frozen=True)
class RematReport:
    policy: str
    pairs: tuple[PairRemat, ...]
    # layers unrolled in Python (`passes.remat_unrolled`): the stack and each layer's change
    stack: str = ""
    layers: tuple[LayerRemat, ...] = ()
    stack_layers: int = 0  # the stack's depth (`layers` may cover fewer of them)
    period: int = 1  # the stack's layers are units of `period` of the model's layers
    # the step's other stacks (an encoder-decoder's decoder), each all of its layers,
    # and their periods
    others: tuple[tuple[str, tuple[LayerRemat, ...], int], ...] = ()
    skipped: tuple[str, ...] = ()  # other stacks left alone (`layers` counts the first's)
    near: str = ""  # where no stack was found, layers alike but for their backward ops

    @property
    def applied(self) -> bool:
        """Whether the pass changed anything: some residual is recomputed."""
        return any(p.residuals_after < p.residuals_before for p in self.pairs) or any(
            r.recomputed for _, layers, _, _ in self._stacks() for r in layers
        )

    def _stacks(self) -> list[tuple[str, tuple[LayerRemat, ...], int, int]]:
        """(stack, its layers' changes, its depth, its period) per stack changed."""
        first = [(self.stack, self.layers, self.stack_layers, self.period)] if self.layers else []
        return first + [(d, layers, len(layers), k) for d, layers, k in self.others]

    @property
    def bytes_before(self) -> int:
        return sum(p.bytes_before for p in self.pairs)

    @property
    def bytes_after(self) -> int:
        return sum(p.bytes_after for p in self.pairs)

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def recompute_flops(self) -> float:
        return sum(p.recompute_flops for p in self.pairs)

    def why_nothing(self) -> str:
        """Why the pass changed nothing (for a report where `applied` is False)."""
        found = [f"the layer stack {self.stack}"] if self.stack else []
        found += [f"the scan at {p.forward}" for p in self.pairs]
        if found:
            return (
                f"{' and '.join(found)} {'keeps' if len(found) == 1 else 'keep'} no residual "
                f"that {self.policy!r} would recompute (the backward pass already recomputes "
                "them, as under jax.checkpoint / nn.remat)"
            )
        none = "no forward/backward scan pair and no stack of layers unrolled in Python was found"
        return f"{none}: {self.near}" if self.near else none

    def notes(self) -> tuple[str, ...]:
        """Lines for a plan's warnings/notes."""
        if not self.applied:
            return (f"remat ({self.policy}): nothing to rematerialize: {self.why_nothing()}",)
        unrolled = tuple(
            f"remat ({self.policy}): layer stack {stack}: the backward pass of "
            f"{_which(layers, depth, period)} recomputes {layers[-1].recomputed} residuals "
            f"a {'unit' if period > 1 else 'layer'} (keeps {layers[-1].stored}), "
            f"{format_bytes(sum(r.recomputed_bytes for r in layers))} less kept between the "
            f"passes (whole tensors, before sharding; the peak is per device) for "
            f"{sum(r.recompute_flops for r in layers):.3g} more FLOPs a call"
            + (
                "; each layer's recomputation waits for the weight gradients of the layer "
                "above (a max of each added as 0 to its input: this compiler drops the "
                "barriers that order it elsewhere)"
                if any(r.waits for r in layers)
                else ""
            )
            for stack, layers, depth, period in self._stacks()
        ) + tuple(
            f"remat ({self.policy}): layer stack {stack} is not rematerialized (remat on the "
            "first layers only covers the first stack)"
            for stack in self.skipped
        )
        return unrolled + tuple(
            f"remat ({self.policy}): the backward loop at {p.backward} recomputes "
            f"{p.residuals_before - p.residuals_after} of {p.residuals_before} residuals of "
            f"{p.forward}: stored {format_bytes(p.bytes_after)} instead of "
            f"{format_bytes(p.bytes_before)} (whole tensors, before sharding; "
            f"{format_bytes(p.bytes_per_layer_after)} a loop step "
            f"instead of {format_bytes(p.bytes_per_layer_before)}, {p.layers} steps: a layer "
            "each, or a pipeline stage's layers) for "
            f"{p.recompute_flops:.3g} more FLOPs a call"
            for p in self.pairs
        )

    def __str__(self) -> str:
        return "\n".join(self.notes())


def _which(layers: tuple[LayerRemat, ...], of: int, period: int = 1) -> str:
    """`8 layers`, `layers 0-3 of 8`; of a stack of units of `period` layers, `4 units
    of 2 layers`, `units 0-1 of 4 (2 layers each)`."""
    if len(layers) >= of:
        n = len(layers)
        return f"{n} units of {period} layers" if period > 1 else f"{n} layers"
    unit, each = ("units", f" ({period} layers each)") if period > 1 else ("layers", "")
    return f"{unit} {layers[0].index}-{layers[-1].index} of {of}{each}"
