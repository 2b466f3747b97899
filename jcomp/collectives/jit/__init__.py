"""A jax.jit program's gradient reduction: cc.value_and_grad and what only it uses."""
