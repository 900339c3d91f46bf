"""Layer kinds as specs (spec.py): the mixers (kda.py, mla.py) and MLPs (mlps.py) a decoder layer is made of, and
the registry (registry.py) every other module reads instead of testing a kind's name."""
