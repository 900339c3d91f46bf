"""The checkpoint pipeline: schema -> inventory -> TP plan -> memory preflight -> agreement -> upload."""
