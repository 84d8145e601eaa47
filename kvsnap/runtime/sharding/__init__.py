"""A model sharded over several processes with MLX's distributed engine (``mlx.launch``): the
ranks' collectives, each rank's slice of the model, and a logical state gathered from them."""
