"""Layer stacks in unrolled graphs: which ops are layer i's, forward and backward.

Most models unroll their layers in Python (`for i in range(n): x =
Block(name=f"layers_{i}")(x)`, NNX's list of blocks), so a captured graph repeats one
block's ops n times; a pass that treats a layer as a unit (solve it once, cut pipeline
stages between layers) needs each layer's ops. Module names cannot be relied on (NNX
and plain JAX carry none), so ops are assigned by dataflow from each layer's parameters;
names read: the `jvp(`/`transpose(` wrappers JAX writes under `grad` (forward, backward;
the optimizer's ops are in neither), and a layer's own name for what it sows of its
output (step 3), which the data alone give the next layer. docs/algorithms.md,
"Layer stacks in unrolled graphs", has the whole story; in short:

1. `stack_candidates.candidates`: inputs whose paths differ in one integer-ending component share a
   template (`params/layers_<i>`), and siblings numbered alike one more
   (`params/{ln_,mlp_}<i>`); consecutive indices with the same leaves form a run.
   A run no forward op reads that mirrors a run's paths and shapes (all of them, or
   some: no state for a layer's RNG key) is its optimizer state
   (`opt_state/0/mu/params/layers_<i>`), kept as `Block.state`.
2. `_label`: forward, an op's layer is the highest whose parameters it depends on;
   backward, the lowest whose parameters or residuals it reads. The *core* of a layer
   is its ops that read its parameters/residuals or lead to one that does.
3. `_split`: the rest (the gap to the next layer) is cut where one value alone is
   live, the residual stream or its cotangent: before the cut is this layer's tail,
   after it the next layer's head (a side output, an aux loss, stays with its layer;
   their sum across layers is in none). `_ends` matches the open ends (the first head,
   the last tail) from their neighbours'. Cotangent sums across layers belong to none.
4. `_absorb`: parameter-free ops (RoPE tables, a mask's broadcast) join the one layer
   that reads them. A run stops where a block's op signatures change or a layer does
   not read the previous one's output. A few linear sweeps: 60k ops take ~1 s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from autopar.ir.graph import BACKWARD, FORWARD, OTHER, Graph, phases, signature
from autopar.passes.stack_candidates import Layer, candidates, indexed_names, runs_of
from autopar.passes.stack_pad import Pad, first_layer_pads

__all__ = ["Block", "LayerStack", "find_stacks", "indexed_names", "signature", "units_named"]

_FWD, _BWD, _OTHER = FORWARD, BACKWARD, OTHER


@dataclass(frozen=True)
class Block:
    """One layer's ops in one phase. `params` are positions in `graph.inputs` (sorted by
    path), `state` the positions of their optimizer-state mirrors (mu, nu, ...);
    `inputs` are the values read from outside other than params and constants,
    `outputs` the values made here and read outside (or returned)."""

    index: int
    nodes: tuple[int, ...]
    params: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    state: tuple[int, ...] = ()


@dataclass(frozen=True)
class LayerStack:
    """A run of structurally identical layers. `forward` in program order; `backward`
    (the differentiated step's gradient ops per layer) in program order, so the last
    layer first, and `()` when the function is not differentiated."""

    template: str
    forward: tuple[Block, ...]
    backward: tuple[Block, ...] = ()
    # the layers of the template next to the run that its forward ops match but its
    # backward ops do not, which the stack leaves out (said in `describe`)
    left_out: tuple[int, ...] = ()
    # the ops the first layer's blocks lack (it reads an argument of the step, whose
    # gradient JAX does not compute), which `stack_pad.padded` writes in for a roll
    pads: tuple[Pad, ...] = ()
    # the first layers of the run left outside, so that the rest splits into a
    # pipeline's stages (`split_into`)
    outside: tuple[int, ...] = ()
    # the template's other layers, whose ops differ from the run's (T5's first block,
    # which computes the relative position bias)
    apart: tuple[int, ...] = ()
    # layers a unit: the stack's "layers" are units of `period` consecutive layers of the
    # template where its layers alternate between kinds (`Block.index` is a unit's first)
    period: int = 1

    def named(self) -> str:
        """`the 8 layers of T`, or `the 4 units of 2 layers of T` (`period`)."""
        return units_named(len(self.forward), self.period, self.template)

    def members(self, block: Block) -> range:
        """The template's layer indices that `block` (one unit) holds."""
        return range(block.index, block.index + self.period)

    def describe(self) -> str:
        # the forward and backward ranges apart: between them run the ops after the
        # stack (another stack, a decoder after an encoder)
        apart = ", ".join(map(str, self.apart))
        one = len(self.apart) == 1
        unit = f" units of {self.period} layers" if self.period > 1 else ""
        text = f"{len(self.forward)}{unit} x {self.template}" + (
            f" (layer{'' if one else 's'} {apart} not in it: {'its' if one else 'their'} "
            "parameters or ops differ from the others')"
            if self.apart
            else ""
        )
        text += ", ops " + ", backward ".join(
            f"{min(ids)}..{max(ids)}"
            for blocks in (self.forward, self.backward)
            if (ids := [i for b in blocks for i in b.nodes])
        )
        if self.pads:
            text += (
                f" (layer {self.forward[0].index} reads an argument of the step, or what "
                "ops of no layer make of arguments alone (a frozen embedding), whose "
                f"gradient JAX does not compute: it lacks {len(self.pads)} ops of the "
                "others', which a pipeline computes and drops)"
            )
        if self.outside:
            a, b = self.outside[0], self.outside[-1]
            text += (
                f" (layer{f's {a}..{b} run' if b != a else f' {a} runs'} outside the pipeline, "
                f"before its first stage: the other {len(self.forward)} split into its stages)"
            )
        return f"{text} ({self.why_left_out()})" if self.left_out else text

    def split_into(self, stages: int) -> LayerStack | None:
        """This stack without as many of its first layers as keep the rest from
        splitting into `stages` equal stages, those layers then `outside` it (run as the
        step's other ops, before the pipeline); itself where it splits, None where fewer
        layers than stages would remain. Its padded first layer (`pads`) is among the
        first to go."""
        r = len(self.forward) % stages
        if not r:
            return self
        if len(self.forward) - r < stages:
            return None
        firsts = {b.index for b in self.forward[:r]}
        return replace(
            self,
            forward=self.forward[r:],
            backward=tuple(b for b in self.backward if b.index not in firsts),
            pads=(),
            outside=(*self.outside, *(i for b in self.forward[:r] for i in self.members(b))),
        )

    def why_left_out(self) -> str:
        """Which layers `left_out` holds and why ("" when none)."""
        if not self.left_out:
            return ""
        return (
            f"layer {', '.join(map(str, self.left_out))} left out: its forward ops are the "
            f"others' but its backward ops differ, {BACKWARD_DIFFERS}"
        )


def units_named(n: int, period: int, template: str) -> str:
    """`the 8 layers of T`, or, where the stack's layers are units of `period`
    consecutive ones, `the 4 units of 2 layers of T`."""
    unit = f"units of {period} layers" if period > 1 else "layers"
    return f"the {n} {unit} of {template}"


# why a layer's backward ops differ from its stack's when its forward ops do not
BACKWARD_DIFFERS = (
    "as when the stack's first layer reads an argument of the step, whose gradient JAX "
    "does not compute; a layer before the stack, or a step that differentiates that "
    "argument too, makes them alike"
)


def find_stacks(graph: Graph, min_layers: int = 2) -> tuple[LayerStack, ...]:
    """The runs of at least `min_layers` (2 or more) identical unrolled layers of `graph`,
    ordered by their first forward op. Layers under `scan` are not reported."""
    min_layers, phase = max(min_layers, 2), phases(graph)
    found: list[LayerStack] = []
    seen, taken, failed = set(), set(), set()  # input positions, node ids, candidate keys
    for template, layers in candidates(graph, phase, min_layers):
        positions = {p for layer in layers for _, p in layer.leaves}
        # skip a run inside an outer layer (`layers_3/Dense_<i>`), or like one that failed
        # (`h_0/ln_<i>`, then `h_1/ln_<i>`, ...: analysing each would be quadratic)
        shapes = [(s, graph.values[graph.inputs[p]].shape) for s, p in layers[0].leaves]
        key = repr((re.sub(r"\d+", "#", template), shapes))
        if positions & seen or key in failed:
            continue
        stacks = _Stack(graph, phase, template, layers).stacks(min_layers)
        if stacks or len(indexed_names(template)) == 1:  # siblings: else one by one
            seen |= positions
        failed |= set() if stacks else {key}
        for stack in stacks:
            ids = {i for b in stack.forward + stack.backward for i in b.nodes}
            if not ids & taken:
                taken |= ids
                found.append(replace(stack, apart=_apart(graph, stack)))
    return tuple(sorted(found, key=lambda s: s.forward[0].nodes[0]))


def _apart(graph: Graph, stack: LayerStack) -> tuple[int, ...]:
    """The indices of `stack.template`'s layers among the step's arguments that the
    stack leaves out for no reason it records (their parameters or ops differ)."""
    if len(indexed_names(stack.template)) != 1:
        return ()
    pattern = re.compile(re.escape(stack.template).replace(re.escape("<i>"), r"(\d+)") + "(?:/|$)")
    present = {int(m.group(1)) for p in graph.input_paths if (m := pattern.match(p))}
    inside = {i for b in stack.forward for i in stack.members(b)}
    inside |= {i + q for i in stack.left_out for q in range(stack.period)}
    return tuple(sorted(present - inside))


class _Stack:
    """The analysis of one candidate run of layers (numbered 0..n-1 here)."""

    def __init__(self, graph: Graph, phase: Sequence[int], template: str, layers: list[Layer]):
        self.g, self.phase, self.template, self.layers = graph, phase, template, layers
        self.n, self.cons, self.prod = len(layers), graph.consumers, graph.producer
        self.param = {graph.inputs[p]: k for k, ly in enumerate(layers) for _, p in ly.leaves}
        self._sigs: dict[int, int] = {}
        self._interned: dict[tuple, int] = {}
        self.owner: dict[int, tuple[int, int]] = {}  # node -> (phase, layer)
        self.lo: dict[int, int] = {}  # forward op -> its layer
        self.bl: dict[int, int] = {}  # backward op -> its layer
        self.acc: set[int] = set()  # backward ops accumulating a cotangent across layers

    def sig(self, i: int) -> int:
        """An op's structure as a small int: primitive, types, simple params."""
        if i not in self._sigs:
            key = signature(self.g, self.g.nodes[i])
            self._sigs[i] = self._interned.setdefault(key, len(self._interned))
        return self._sigs[i]

    def seq(self, ids: Iterable[int]) -> tuple[int, ...]:
        return tuple(self.sig(i) for i in sorted(ids))

    def _scoped(self, i: int, k: int) -> bool:
        """Whether op `i` runs in layer `k`'s module: its name stack names the layer."""
        comps = self.g.nodes[i].name_stack.split("/")
        idx = {str(m) for m in self.layers[k].members}
        if (names := indexed_names(self.template)) == ("",):  # `layers/<i>`: named 0..n-1
            parent = self.template.rsplit("/", 2)[-2] if "/" in self.template else ""
            return any(a == parent and c in idx for a, c in zip(comps, comps[1:]))
        return any(c == f"{nm}{m}" for c in comps for nm in names for m in idx)

    # ------------------------------------------------------------------ labels and cuts
    def _label(self, order: list, src: dict[int, int], pick) -> tuple[dict[int, int], set[int]]:
        """Per op of `order` (one phase, program order), `pick` (max: forward, min:
        backward) of the layers of what it reads: `src` values (parameters, residuals;
        a cast or reshape of them joins them) and labelled ops' outputs. The core: ops
        that read their own layer's `src` or lead, within the layer, to one that does.
        An `add_any` summing one layer's cotangent into another's that nothing else
        reads (the gradient of a value every layer reads: an encoder's output, a tied
        weight) accumulates across layers: it is in none, else the first would differ."""
        lab: dict[int, int] = {}
        vlab: dict[int, int] = {}
        direct, consts, acc = set(), self.g.consts, self.acc
        for nd in order:
            labs = [src[x] for x in nd.inputs if x in src]
            labs += [vlab[x] for x in nd.inputs if x in vlab]
            b = pick(labs) if labs else None
            if (
                pick is min
                and nd.op == "add_any"
                and any(  # one operand from another layer
                    (self.prod.get(x) in acc or vlab.get(x, b) != b)
                    and all(self.g.nodes[c].op == "add_any" for c in self.cons.get(x, ()))
                    for x in nd.inputs
                )
            ):
                acc.add(nd.id)
            elif b is not None:
                lab[nd.id] = b
                vlab.update((y, b) for y in nd.outputs)
                if any(src.get(x) == b for x in nd.inputs):
                    direct.add(nd.id)
                if all(src.get(x) == b or x in consts for x in nd.inputs):
                    src.update((y, b) for y in nd.outputs)
        for nd in reversed(order):  # the accumulation's first sum (within one layer)
            if acc and nd.op == "add_any" and nd.id in lab:
                cs = [c for y in nd.outputs for c in self.cons.get(y, ())]
                if cs and all(c in acc for c in cs):
                    acc.add(nd.id)
                    del lab[nd.id]
        core: set[int] = set()
        for nd in reversed(order):
            b = lab.get(nd.id)
            if b is not None and (
                nd.id in direct
                or any(c in core and lab[c] == b for y in nd.outputs for c in self.cons.get(y, ()))
            ):
                core.add(nd.id)
        return lab, core

    def _split(self, order: list, lab: dict[int, int], core: set[int], step: int, late: bool):
        """(cores, heads, tails) per layer. A layer's gap (its ops outside the core) is
        cut at its first (`late`: last) op after which one value alone is live (the
        residual stream or its cotangent; counting what enters the first layer, not
        masks, weights or what only an accumulation reads): up to the cut it is the
        layer's tail, downstream of it the head of the layer `step` after in this phase.
        A gap op whose results reach no later layer's core (a load-balancing loss each
        layer adds to a sum the loss reads) is its layer's tail, and its results are not
        counted live; nor are those of the ops that add them up across layers (in none)."""
        last: dict[int, int] = {}
        for nd in order:  # a value's last reader, sums across layers aside: the first
            # backward layer's share of a shared value's gradient (T5's position bias)
            # waits for the next layer's share, but is no live value of the gap
            if nd.id not in self.acc:
                last.update((x, nd.id) for x in nd.inputs)
        cons, first = self.cons, 0 if step > 0 else self.n - 1
        side, across = self._side(order, lab, core, step)

        def entering(v: int) -> bool:  # an unlabelled value only the first layer reads
            if v in self.g.consts or v in self.param:
                return False
            return {lab[c] for c in cons.get(v, ()) if c in lab} == {first}

        live = {x for x in self.g.inputs if x in last and entering(x)}
        done = {lab[i]: i for i in sorted(core)}  # per layer, its last core op
        cut: dict[int, int] = {}  # after `done` (an aux loss's backward after the residual's)
        for nd in order:
            for x in nd.inputs:
                if last.get(x) == nd.id:
                    live.discard(x)
            b = lab.get(nd.id)
            outs = [y for y in nd.outputs if last.get(y, -1) > nd.id and set(cons[y]) - self.acc]
            outs = [] if nd.id in side or nd.id in across else outs
            live.update(outs if b is not None else filter(entering, outs))
            single = len(live) == len(outs) == 1
            if b is not None and nd.id > done.get(b, -1) and (late or b not in cut) and single:
                cut[b] = nd.id
        cores, heads, tails = ([set() for _ in range(self.n)] for _ in range(3))
        after: dict[int, set[int]] = {}  # layer -> values downstream of its cut
        for nd in order:
            b = lab.get(nd.id)
            if b is None or nd.id in across:
                continue
            if nd.id in core:
                cores[b].add(nd.id)
            elif nd.id in side:
                tails[b].add(nd.id)
            elif b in after and any(x in after[b] for x in nd.inputs):
                after[b].update(nd.outputs)
                if 0 <= b + step < self.n:
                    heads[b + step].add(nd.id)
            else:
                tails[b].add(nd.id)
                if nd.id == cut.get(b):
                    after[b] = set(nd.outputs)
        return cores, heads, tails

    def _side(self, order, lab, core, step: int) -> tuple[set[int], set[int]]:
        """(side, across): the labelled ops outside the core that compute from cores (or
        such ops) alone and whose results reach no other layer's core. A layer's side
        outputs (an aux loss) are computed before the next layer's core and from its own
        values; the others accumulate them across layers (their sum after the stack)
        and are in no layer."""
        feeds: set[int] = set()
        for nd in reversed(order):
            b = lab.get(nd.id)
            if b is not None and any(
                c in feeds or (c in core and lab[c] != b)
                for y in nd.outputs
                for c in self.cons.get(y, ())
            ):
                feeds.add(nd.id)
        outs, returned = set(self.g.outputs), set()  # ops whose results only the step returns
        for nd in reversed(order):
            cs = {c for y in nd.outputs for c in self.cons.get(y, ())}
            if all(y in outs or self.cons.get(y) for y in nd.outputs) and cs <= returned:
                returned.add(nd.id)
        first_core: dict[int, int] = {}
        for i in sorted(core, reverse=True):
            first_core[lab[i]] = i
        done = {lab[i]: i for i in sorted(core)}  # per layer, its last core op
        side: set[int] = set()
        across: set[int] = set()
        for nd in order:
            if nd.id not in lab or nd.id in core or nd.id in feeds:
                continue
            made = [self.prod.get(x) for x in nd.inputs if x not in self.g.consts]
            b, nxt = lab[nd.id], first_core.get(lab[nd.id] + step)
            # what the layer's own module makes for the step's results only (a statistic
            # of its output it sows; by data alone, the next layer's head) may read it all
            sown = nd.id in returned and self._scoped(nd.id, b)
            # what the layer computes before its last core op is its own (MoE routing)
            end = float("inf") if sown else done.get(b, -1)
            if not made or not all(
                i in core or i in side or i in across or (lab.get(i) == b and i < end) for i in made
            ):
                continue
            own = all(lab.get(i) == b and i not in across for i in made)
            (side if own and (nxt is None or nd.id < nxt) else across).add(nd.id)
        for i in sorted(side):  # a sum's first term, `0.0 + aux` (`sum(auxes)`): across too
            nd, sig = self.g.nodes[i], self.sig(i)
            sums = [c for y in nd.outputs for c in self.cons.get(y, ()) if c in across]
            if any(x in self.g.consts for x in nd.inputs) and any(self.sig(c) == sig for c in sums):
                side.discard(i)
                across.add(i)
        return side, across

    def _ends(self, order, lab, core, step: int, pairs=()) -> list[set[int]]:
        """Blocks per layer. The first layer's head (in this phase's order) and the last
        one's tail border ops of no layer (the embedding, the final norm, the gradient
        below the stack), so they are matched op by op from their neighbours'. When
        that fails with the gaps cut at their first single live value (`x = f(x)` then a
        pre-norm), they are cut at their last (`x = relu(dense(x))` after a bare stem)."""
        n, free = self.n, {nd.id for nd in order if nd.id not in lab}
        a, z = (0, n - 1) if step > 0 else (n - 1, 0)
        gap = {i for i, b in lab.items() if b == z and i not in core}
        first = None
        for late in (False, True):
            cores, heads, tails = self._split(order, lab, core, step, late)
            head = self._match_back(cores[a + step], cores[a], heads[a + step], free)
            heads[a] = set(head or ())
            ref = [(cores[z - step] | heads[z - step], cores[z] | heads[z]), *pairs]
            vm = self._value_map(z - step, z, ref)
            tail = None if vm is None else self._match_forward(sorted(tails[z - step]), vm, gap)
            tails[z] = set(tail or ())
            blocks = [c | h | t for c, h, t in zip(cores, heads, tails)]
            if head is not None and tail is not None:
                return blocks
            first = first or blocks
        return first

    def _backward(self, fblocks: list[set[int]]) -> list[set[int]]:
        g, outs, src = self.g, set(self.g.outputs), dict(self.param)
        for k, blk in enumerate(fblocks):  # each block's internal values: its residuals
            for y in (y for i in blk for y in g.nodes[i].outputs if y not in outs):
                if all(c in blk or self.phase[c] != _FWD for c in self.cons.get(y, ())):
                    src[y] = k
        bwd = [nd for nd in g.nodes if self.phase[nd.id] == _BWD]
        self.bl, core = self._label(bwd, src, min)
        return self._ends(bwd, self.bl, core, -1, [(fblocks[1], fblocks[0])])

    def _value_map(self, ref: int, tgt: int, pairs) -> dict[int, int] | None:
        """Values of layer `ref` -> layer `tgt`: parameters by path, and the outputs of
        each pair of node sets taken position by position (None if they differ)."""
        leaves = dict(self.layers[tgt].leaves)
        vm = {self.g.inputs[p]: self.g.inputs[leaves[s]] for s, p in self.layers[ref].leaves}
        for a, b in pairs:
            if self.seq(a) != self.seq(b):
                return None
            for i, j in zip(sorted(a), sorted(b)):
                vm.update(zip(self.g.nodes[i].outputs, self.g.nodes[j].outputs))
        return vm

    # ------------------------------------------------------------------ matching
    def _match_forward(self, ref: list[int], vm: dict[int, int], free: set[int]):
        """The image of ops `ref` (ascending) among `free`: for each, the first free op of
        the same signature that reads the images of its inputs where they have one."""
        nodes, out, free = self.g.nodes, [], set(free)
        for r in ref:
            ins = nodes[r].inputs
            anchor = next((vm[x] for x in ins if x in vm), None)
            c = next((c for c in self.cons.get(anchor, ()) if c in free and self.sig(c) == self.sig(r)
                      and all(vm.get(x, y) == y for x, y in zip(ins, nodes[c].inputs))), None)  # fmt: skip
            if c is None:
                return None
            free.discard(c)
            out.append(c)
            vm.update(zip(nodes[r].outputs, nodes[c].outputs))
        return out

    def _match_back(self, ref_core, tgt_core, ref: set[int], free: set[int]):
        """The image of ops `ref` (the head feeding `ref_core`) among `free`, walking back
        from `tgt_core`'s inputs position by position, then forward for the head's ops
        that the core does not read; None when the structure differs."""
        if self.seq(ref_core) != self.seq(tgt_core):
            return None
        nodes, m, entry, used = self.g.nodes, {}, {}, set()
        todo = [
            xy
            for i, j in zip(sorted(ref_core), sorted(tgt_core))
            for xy in zip(nodes[i].inputs, nodes[j].inputs)
        ]
        while todo:
            x, y = todo.pop()
            r, t = self.prod.get(x), self.prod.get(y)
            if r not in ref:  # the value entering the head (or a constant, a mask)
                entry.setdefault(x, y)
                continue
            if r in m:
                if m[r] != t:
                    return None
                continue
            if t not in free or t in used or self.sig(t) != self.sig(r):
                return None
            if nodes[r].outputs.index(x) != nodes[t].outputs.index(y):
                return None
            m[r] = t
            used.add(t)
            todo.extend(zip(nodes[r].inputs, nodes[t].inputs))
        # ops of the head that only the backward reads (jvp residuals): forward from it
        vm = {x: y for r, t in m.items() for x, y in zip(nodes[r].outputs, nodes[t].outputs)}
        vm.update((x, y) for x, y in entry.items() if x not in self.g.consts)
        rest = self._match_forward(sorted(ref - m.keys()), vm, free - used)
        return None if rest is None else [*m.values(), *rest]

    # ------------------------------------------------------------------ assembly
    def _absorb(self, cands: set[int]) -> None:
        """Give a parameter-free op (`cands`) to its phase's block of the one layer that
        reads all it makes (forward or backward), when what it reads is constant, its
        own, or read by several layers (a mask)."""
        nodes, cons, outs, owner = self.g.nodes, self.cons, set(self.g.outputs), self.owner
        tent: dict[int, tuple[int, int]] = {}

        def layer(c: int) -> int | None:
            o = owner.get(c, tent.get(c))
            return None if o is None else o[1]

        for i in sorted(cands, reverse=True):
            who = {layer(c) for y in nodes[i].outputs for c in cons.get(y, ())}
            if len(who) == 1 and None not in who and not outs & set(nodes[i].outputs):
                tent[i] = (self.phase[i], who.pop())

        def kept(i: int, x: int) -> bool:  # a constant, its own, several layers' (a mask),
            # or, backward, its layer's forward input (what a `jax.checkpoint` recomputes from)
            if x in self.g.consts or tent.get(self.prod.get(x)) == tent[i]:
                return True
            readers = {owner.get(c, tent.get(c)) for c in cons.get(x, ())} - {None}
            if self.phase[i] == _BWD and (_FWD, tent[i][1]) in readers:
                return True
            return len({r[1] for r in readers}) > 1

        for i in sorted(tent):
            if not all(kept(i, x) for x in nodes[i].inputs):
                del tent[i]
        for i in sorted(tent, reverse=True):  # what only a dropped op read goes too
            if any(layer(c) != tent[i][1] for y in nodes[i].outputs for c in cons.get(y, ())):
                del tent[i]
        owner.update(tent)

    def stacks(self, min_layers: int) -> list[LayerStack]:
        got = self.keyed()
        if got is None:
            return []
        fblocks, bblocks, keys, linked, diff = got
        same = lambda a, b: keys[a] == keys[b] and linked[a]  # noqa: E731
        alike = lambda k, at: keys[k][0] == keys[at][0] and linked[min(k, at)]  # noqa: E731
        out = []
        for r in runs_of(list(range(self.n)), same):
            k = r[0] - 1  # a first layer on an argument of the step: padded, if it aligns
            pads = (
                first_layer_pads(self, k, r[0], fblocks, bblocks) if k >= 0 and linked[k] else None
            )
            r = [k, *r] if pads else r
            if len(r) < min_layers:
                continue
            ends = [(r[0] - 1, r[0]), (r[-1] + 1, r[-1])]
            off = tuple(self.layers[k].index for k, at in ends if 0 <= k < self.n and alike(k, at))
            out.append(
                replace(self._stack(r, fblocks, bblocks, diff), left_out=off, pads=pads or ())
            )
        return out

    def keyed(self):
        """Each layer's forward and backward blocks, their op sequences and whether each
        layer feeds the next; None where the template's layers hold no forward ops."""
        g, n = self.g, self.n
        fwd = [nd for nd in g.nodes if self.phase[nd.id] == _FWD]
        self.lo, core = self._label(fwd, dict(self.param), max)
        fblocks = self._ends(fwd, self.lo, core, +1)
        if not any(fblocks):
            return None
        diff = _BWD in self.phase
        bblocks = self._backward(fblocks) if diff else [set() for _ in range(n)]
        self.owner.update({i: (_FWD, k) for k, b in enumerate(fblocks) for i in b})
        self.owner.update({i: (_BWD, k) for k, b in enumerate(bblocks) for i in b})
        free = {i for i, p in enumerate(self.phase) if p != _OTHER}
        free -= self.lo.keys() | self.bl.keys()
        self._absorb(free - self.owner.keys())
        fblocks, bblocks = [set() for _ in range(n)], [set() for _ in range(n)]
        for i, (p, k) in self.owner.items():
            (fblocks if p == _FWD else bblocks)[k].add(i)
        keys = [(self.seq(f), self.seq(b)) for f, b in zip(fblocks, bblocks)]
        made = [{y for i in b for y in g.nodes[i].outputs} for b in fblocks]
        linked = [
            any(x in made[k] for i in fblocks[k + 1] for x in g.nodes[i].inputs)
            for k in range(n - 1)
        ]
        return fblocks, bblocks, keys, linked, diff

    def _stack(self, ks: list[int], fblocks, bblocks, diff: bool) -> LayerStack:
        g, gout = self.g, set(self.g.outputs)

        def block(k: int, ids: set[int]) -> Block:
            layer = self.layers[k]
            params = sorted((p for _, p in layer.leaves), key=lambda p: g.input_paths[p])
            if layer.period > 1:  # a unit's, by the path below its offset: all line up
                params = [p for _, p in layer.leaves]
            made = {y for i in ids for y in g.nodes[i].outputs}
            ins = {x for i in ids for x in g.nodes[i].inputs if x not in g.consts}
            ins -= made | {g.inputs[p] for p in params}
            outs = {y for y in made if y in gout or set(self.cons.get(y, ())) - ids}
            return Block(layer.index, tuple(sorted(ids)), tuple(params), tuple(sorted(ins)),
                         tuple(sorted(outs)), layer.state)  # fmt: skip

        fwd = tuple(block(k, fblocks[k]) for k in ks)
        bwd = sorted((block(k, bblocks[k]) for k in ks), key=lambda b: b.nodes[:1])
        ok = diff and all(b.nodes for b in bwd)
        period = self.layers[0].period
        return LayerStack(self.template, fwd, tuple(bwd) if ok else (), period=period)
