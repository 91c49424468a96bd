"""The streaming service, one folder per role: ``worker/`` (queries → answers), ``learner/`` (feedback → windows,
policies), ``gateway/`` (the OpenAI-compatible HTTP front), ``common/`` (what they share). ``run`` builds each
process from the settings; ``asyncapi`` writes the message documents. The local stack of ``rlens up`` is
:mod:`rlens.local`, apart from what a production image runs."""
