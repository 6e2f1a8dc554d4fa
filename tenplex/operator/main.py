"""``kopf run -m tenplex.operator.main``: the operator's handlers in kopf's default registry.

May import: kopf, kubernetes and the package. Settings come from the same
``TENPLEX_*`` environment variables as ``tenplex operator run``'s defaults.
"""

import os

import kopf
import kubernetes

from .handlers import Operator
from .settings import WorkerSettings

try:
    kubernetes.config.load_incluster_config()
except kubernetes.config.ConfigException:
    kubernetes.config.load_kube_config()

Operator(kubernetes.client.ApiClient(), WorkerSettings.from_env(),
         interval=float(os.environ.get("TENPLEX_RECONCILE_INTERVAL", "10"))).register(kopf.get_default_registry())
