"""Example models built on jax_cp.CPAttention, their data pipeline and the training entry point."""
