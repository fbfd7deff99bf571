"""wacc_ref: the exact reference model of the wacc accumulation semantics (no torch)."""
