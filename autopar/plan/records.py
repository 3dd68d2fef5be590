"""A plan's records: an argument or result (`TensorRecord`), an op (`OpRecord`), a
loop body's or cond branch's plan (`BodyRecord`), and specs as the plan file writes
them."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost.model import Cost
from autopar.sharding import Spec


@dataclass(frozen=True)
class TensorRecord:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    # a leaf of a pipelined layer unrolled in Python (`Plan.user_inputs`): the stage
    # whose devices alone hold it, `spec` being its layout on that stage's sub-mesh
    stage: int | None = None

    def to_json(self) -> dict:
        d = {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "spec": _spec_json(self.spec),
        }
        return d if self.stage is None else {**d, "stage": self.stage}

    @staticmethod
    def from_json(d: dict) -> TensorRecord:
        spec = _spec_from(d["spec"])
        return TensorRecord(d["path"], tuple(d["shape"]), d["dtype"], spec, d.get("stage"))


@dataclass(frozen=True)
class OpRecord:
    key: str  # stable: name stack + primitive + index
    op: str
    source: str
    strategy: str
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    compute_s: float
    body: BodyRecord | None = None  # a scan's body plan
    branches: tuple[BodyRecord, ...] | None = None  # a cond's branch plans
    # the library line (Flax, optax, ...) that made the op when `source`, the user's
    # line, is not it; "" otherwise (and in plans written before the field)
    library_source: str = ""
    # the layer the search placed the op in where its key names none (an NNX model's
    # ops, a plain function's: `search.layers.op_layer_names`); "" otherwise
    layer: str = ""

    def to_json(self) -> dict:
        d = {
            "key": self.key,
            "op": self.op,
            "source": self.source,
            "strategy": self.strategy,
            "in_specs": [_spec_json(s) for s in self.in_specs],
            "out_specs": [_spec_json(s) for s in self.out_specs],
            "compute_s": self.compute_s,
        }
        if self.library_source:
            d["library_source"] = self.library_source
        if self.layer:
            d["layer"] = self.layer
        if self.body is not None:
            d["body"] = self.body.to_json()
        if self.branches is not None:
            d["branches"] = [b.to_json() for b in self.branches]
        return d

    @staticmethod
    def from_json(d: dict) -> OpRecord:
        return OpRecord(
            d["key"],
            d["op"],
            d["source"],
            d["strategy"],
            tuple(_spec_from(s) for s in d["in_specs"]),
            tuple(_spec_from(s) for s in d["out_specs"]),
            float(d["compute_s"]),
            BodyRecord.from_json(d["body"]) if "body" in d else None,
            tuple(BodyRecord.from_json(b) for b in d["branches"]) if "branches" in d else None,
            d.get("library_source", ""),
            d.get("layer", ""),
        )


@dataclass(frozen=True)
class BodyRecord:
    """A scan body's plan, searched once and used for every step of the loop: the
    body's inputs (consts, carry, one slice of each xs), outputs and ops, as in a
    Plan; `cost` is one step's. A cond branch's plan too: its inputs are the cond's
    operands, its outputs the cond's results in the cond's specs (the branch reshards
    into them), `cost` the branch's own."""

    engine: str
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]
    ops: tuple[OpRecord, ...]
    cost: Cost

    def to_json(self) -> dict:
        return {
            "engine": self.engine,
            "cost": self.cost.to_json(),
            "inputs": [r.to_json() for r in self.inputs],
            "outputs": [r.to_json() for r in self.outputs],
            "ops": [o.to_json() for o in self.ops],
        }

    @staticmethod
    def from_json(d: dict) -> BodyRecord:
        return BodyRecord(
            d["engine"],
            tuple(TensorRecord.from_json(r) for r in d["inputs"]),
            tuple(TensorRecord.from_json(r) for r in d["outputs"]),
            tuple(OpRecord.from_json(o) for o in d["ops"]),
            Cost.from_json(d["cost"]),
        )


def _spec_json(s: Spec) -> dict | list:
    return {"dims": s.to_json(), "partial": list(s.partial)} if s.partial else s.to_json()


def _spec_from(d) -> Spec:
    key = str(d)  # a plan repeats a few specs many times (a large plan loads in 1/3 the time)
    spec = _SPECS.get(key)
    if spec is None:
        if isinstance(d, dict):
            spec = Spec(Spec.from_json(d["dims"]).dims, tuple(d["partial"]))
        else:
            spec = Spec.from_json(d)
        if len(_SPECS) < 100_000:
            _SPECS[key] = spec
    return spec


_SPECS: dict[str, Spec] = {}
