"""What makes a checkpoint trustworthy when it is read: ``manifest`` (xxh3 checksums of every
byte written, the manifest file, verification while reading) and ``safe_unpickle`` (pickles
restricted to an allowlist: a checkpoint never runs code)."""
