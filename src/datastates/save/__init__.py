"""The save stage: planning the layout, capturing tensors into the host cache, writing shard files, the pipeline's threads."""
