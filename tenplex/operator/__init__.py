"""The Kubernetes operator: TenplexJob resources, worker pods, rescaling and recovery.

May import: ``tenplex.elastic.policy``, ``tenplex.errors``, the standard
library, and, in :mod:`.handlers`, :mod:`.main` and :mod:`.pods` only, ``kopf``
and ``kubernetes``. :mod:`.spec`, :mod:`.observe`, :mod:`.decide`, :mod:`.outcome`
and :mod:`.settings` are pure:
no I/O, no Kubernetes client, so that every decision can be tested as a
function from the observed state to the desired state.

Layout:

* :mod:`.spec`: a TenplexJob's ``spec`` parsed and validated (errors name the field);
* :mod:`.observe`: raw Node and Pod objects reduced to what a decision needs;
* :mod:`.decide`: ``decide(...) -> Decision``, the pure reconciliation step;
* :mod:`.outcome`: what a decision asks for (:class:`~.outcome.Decision`) and the status merge patches;
* :mod:`.settings`: the operator's cluster-wide settings (resource name, rendezvous, host paths);
* :mod:`.pods`: the worker pod a decision asks for (``tenplex run`` per node);
* :mod:`.handlers`: the kopf handlers that observe, decide and act;
* :mod:`.main`: the same handlers for ``kopf run -m tenplex.operator.main``.

Worker pods carry exactly the labels ``tenplex.io/job=<name>`` and
``tenplex.io/role=worker`` (tooling selects on them).
"""

GROUP = "tenplex.io"
VERSION = "v1alpha1"
PLURAL = "tenplexjobs"
JOB_LABEL = "tenplex.io/job"
ROLE_LABEL = "tenplex.io/role"
WORKER_ROLE = "worker"
NODE_ANNOTATION = "tenplex.io/node"
# The nodes that run the store DaemonSet (k8s/store.yaml's nodeSelector): only they can run a worker.
STORE_NODE_LABELS = {"tenplex.io/gpu-node": "true"}
