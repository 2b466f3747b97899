"""A GPT trained over the ('data', 'tensor', 'pipeline') mesh with compressed
collectives: the model, the codec policy and its message plan, the 3-D layout,
the ZeRO optimizer and the compiled train and eval steps."""
