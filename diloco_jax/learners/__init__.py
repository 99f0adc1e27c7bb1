"""DiLoCo across independent jobs: learners (today's runs) and a syncer that holds the anchor
and the outer optimizer, over gRPC (the ``learners`` extra). See docs/guides/learners.md."""
