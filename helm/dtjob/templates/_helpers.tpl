{{/* Chart name, truncated to 63 characters (the DNS label limit of Kubernetes names). */}}
{{- define "dtjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or just the release name when it already contains the chart name. */}}
{{- define "dtjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dtjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dtjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of everything the release owns, without the component. */}}
{{- define "dtjob.releaseLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "dtjob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dtjob
{{- end }}

{{- define "dtjob.labels" -}}
{{ include "dtjob.releaseLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "dtjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dtjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The workers' ServiceAccount: created per watched namespace, or one the user names. */}}
{{- define "dtjob.workerServiceAccountCreated" -}}
{{- if and .Values.workers.serviceAccount.create .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{- define "dtjob.workerServiceAccountName" -}}
{{- if .Values.workers.serviceAccount.name }}
{{- .Values.workers.serviceAccount.name }}
{{- else if include "dtjob.workerServiceAccountCreated" . }}
{{- printf "%s-worker" (include "dtjob.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{- define "dtjob.peeringName" -}}
{{- default (include "dtjob.fullname" .) .Values.peering.name }}
{{- end }}

{{- define "dtjob.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Checks across values that the JSON schema cannot express. Included by the Deployment, so
`helm template`, `lint` and `install` all fail with this message.
*/}}
{{- define "dtjob.validate" -}}
{{- if eq .Values.image.tag "latest" }}
{{- fail "image.tag \"latest\" is refused: pin a version (e.g. the chart's appVersion) or set image.digest" }}
{{- end }}
{{- if eq (int .Values.operator.healthPort) (int .Values.operator.metricsPort) }}
{{- fail (printf "operator.healthPort and operator.metricsPort are both %v: give them different ports" .Values.operator.healthPort) }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.service.enabled: the ServiceMonitor scrapes that Service" }}
{{- end }}
{{- end }}

{{/*
RBAC rules on namespaced resources: the same list for the ClusterRole of an all-namespaces
install and for the Role in each watched namespace. Each rule lists exactly the verbs of the calls
in operator/dtjob/operator/ (kube.py, handlers.py) and of kopf underneath it; tests/e2e/
test_helm_chart.py shows the operator failing without each rule.
*/}}
{{- define "dtjob.namespacedRules" -}}
# The jobs: kopf lists and watches them and patches its finalizer in; the operator reads each
# job before a reconcile and deletes it after runPolicy.ttlSecondsAfterFinished.
- apiGroups: [training.dtjob.io]
  resources: [distributedtrainingjobs]
  verbs: [get, list, watch, patch, delete]
# Phase, conditions, world size, step: the status subresource.
- apiGroups: [training.dtjob.io]
  resources: [distributedtrainingjobs/status]
  verbs: [patch]
# Worker pods: watched (kopf) and listed per job, created per generation, deleted to stop a gang.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
# The headless Service that gives workers their DNS names (read to see whether it exists); it
# goes with the job through its owner reference.
- apiGroups: [""]
  resources: [services]
  verbs: [get, create]
# The final step of a finished job: rank 0's metrics endpoint is gone once it exits, so the
# operator reads the step from the last line of its log (kube.py).
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# Events: one per phase transition and rescale, saying why.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if .Values.volcano.enabled }}
# Volcano gang scheduling: one PodGroup per job, its minMember patched per generation.
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- end }}
{{- end }}

{{/*
Cluster-scoped reads. Nodes: a worker whose node turns NotReady or disappears starts a new
generation, and only the Node object says so (the pod keeps reporting Running until the node
controller evicts it, minutes later); node capacity also decides how far a job shrinks. The
operator lists nodes on each reconcile and never changes them. With volcano.enabled it also reads
Volcano queues. Nothing else cluster-scoped is granted: kopf runs on its startup discovery without
CRD or namespace watches (the operator sets settings.scanning.disabled, handlers.py).
*/}}
{{- define "dtjob.clusterReadRules" -}}
# Nodes, read-only: a NotReady or vanished node restarts the gangs with workers on it.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- if .Values.volcano.enabled }}
# Volcano queues (cluster-scoped), read-only: a waiting gang's job says when its queue is full,
# closed or missing, which the scheduler writes on no object.
- apiGroups: [scheduling.volcano.sh]
  resources: [queues]
  verbs: [get]
{{- end }}
{{- end }}
