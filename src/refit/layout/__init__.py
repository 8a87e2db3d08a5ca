"""Layout: what goes where on the wire, prepared once per epoch (tensor specs, the manifest, the
bucket planner and budget, packing, the live-layout guard, the batched copy kernel)."""
