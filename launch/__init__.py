"""Starting and stopping the serving stack: TorchServe instances (and later the front)."""
