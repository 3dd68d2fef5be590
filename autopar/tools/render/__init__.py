"""`autopar render`: a picture of a plan (PNG, SVG or PDF; matplotlib, Agg backend).

The picture has two parts (three for a pipelined plan):

* **Layers** (left): the model's layers in program order, grouped the way
  `autopar inspect --by layer` groups them (`autopar.tools.inspect.layer_of_path` /
  `layer_of_op`). Each box is filled with the colour of the layer's most common
  contraction strategy and carries a strip coloured by how its parameters are
  split (which mesh axes shard most of their bytes). Consecutive layers whose
  parameters and ops have the same specs and strategies are drawn once:
  `h_0..h_95 (96 identical)`; if there are still too many boxes, consecutive
  layers with the same colours are merged too (`(N similar)`).
* **Parameters** (right): the largest parameters (one per set of same-shaped,
  same-spec parameters across layers, `h_*/mlp/c_fc/kernel x96`), each a
  rectangle (rows: dim 0; columns: the other dims) cut into one tile per shard
  along every sharded dimension and labelled with the mesh-axis coordinates of
  the devices holding it. The dark tile is one device's share.
* **Schedule** (bottom, pipelined plans only): the pipeline's slots per stage over
  time (`autopar.plan.schedule`): forward, backward and head slots labelled with their
  micro-batch, idle ones hatched, with the bubble and the micro-batches each stage
  holds.

Everything is computed from the plan file alone; no function or devices needed.

    layout  the layer boxes and parameter groups, computed from the plan
    draw    the matplotlib figure
"""

from autopar.errors import RenderError
from autopar.tools.render.draw import FORMATS, render_plan
from autopar.tools.render.layout import (
    DEFAULT_TOP,
    MAX_BOXES,
    LayerGroup,
    ParamGroup,
    layer_groups,
    param_groups,
)

__all__ = [
    "DEFAULT_TOP",
    "FORMATS",
    "MAX_BOXES",
    "LayerGroup",
    "ParamGroup",
    "RenderError",
    "layer_groups",
    "param_groups",
    "render_plan",
]
