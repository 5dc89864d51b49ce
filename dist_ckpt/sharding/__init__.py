"""The pure rules behind the mapping objects of ``mapping``: ``geometry`` (boxes and flattened
ranges), ``fields`` (what a ShardedTensor / ShardedObject may say, checked when it is made),
``partition`` (a state dict into its sharded, common and nonpersistent parts, and back),
``fingerprint`` (a save's structure, for cached plans). No I/O."""
