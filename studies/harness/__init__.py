"""What only the studies need of a quality run, around ``fusionrag.bench``: their stores (:mod:`.stores`)
and which stored chunks each question's prompt holds (:mod:`.membership`)."""
