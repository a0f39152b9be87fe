"""The fp8gate commands, the demo and the checkpoint writers."""
