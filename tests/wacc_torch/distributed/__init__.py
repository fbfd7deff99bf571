"""Multi-process tests of wacc_torch across real torch.distributed process groups (gloo)."""
