"""Block format, layer conversion, storage backends and the local block cache (lazily served image layers)."""
