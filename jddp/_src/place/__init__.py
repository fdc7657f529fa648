"""Where the training state lives: replicated, ZeRO-sharded, owner-sharded, offloaded."""
