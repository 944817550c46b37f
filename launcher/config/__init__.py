"""What the user asked for: a YAML file and ``key=value`` overrides -> a checked :class:`.schema.Config`
(:mod:`.schema`, every key and its rule; :mod:`.load`, the file and overrides read against it; :mod:`.checks`, the
rules between keys); a profile name -> its engine, precision and offload, and the DeepSpeed
JSON generated from that one catalogue (:mod:`.profiles`); or the user's own DeepSpeed JSON, read as a custom
profile (:mod:`.user_ds_config`)."""
