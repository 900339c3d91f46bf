"""The memory formulas, in one room: what a run needs beyond its weights' share, from shapes alone.

runtime.py: one prefill chunk's activations (each layer kind's own, kinds/), logits, outputs, workspaces, the guard;
terms.py: the cache, the prefix pool, and the copies made while binding (packing, int8). run/plan.py composes them
into each rank's MemoryTerms; weights/memory.py adds the weights' share and staging and checks the sum against the
free memory it measures (docs/memory.md). traffic.py: the what-if's figure beside memory, what a TP group's
collectives move per token.
"""
