"""CPU training settings: Inductor's options and graph passes, glibc's memory, the fused optimizer step.

May import torch and the top-level modules only.
"""
