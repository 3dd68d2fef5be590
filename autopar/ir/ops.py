"""Op families: the sets of primitive names that several passes treat alike, spelled once."""

from __future__ import annotations

# Contractions: the ops that carry the FLOPs, run on the matrix units, take a precision,
# sum over a contracted dim (so a split contracted dim leaves a partial sum), and whose
# outputs are the activations worth saving under rematerialization.
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
