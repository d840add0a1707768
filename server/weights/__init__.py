"""Live weight updates (D24 in docs/architecture.md): the registry of each model's weights versions
(``registry``), this process's workers' versions and the gate that keeps work off a worker behind its
model's current version (``fleet``), and the push that brings every worker of a model to a new version
(``push``)."""
