{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "specgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name when it already contains the chart name. */}}
{{- define "specgate.fullname" -}}
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

{{- define "specgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specgate
{{- end }}

{{- define "specgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "specgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specgate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference (list REF REGISTRY) with REGISTRY in place of its registry: the first
path part when it names a host (it has a "." or ":" or is localhost), as the container runtime
reads it; Docker Hub's images have none and get REGISTRY in front. */}}
{{- define "specgate.withRegistry" -}}
{{- $ref := index . 0 }}
{{- $registry := trimSuffix "/" (index . 1 | default "") }}
{{- if $registry }}
{{- $parts := splitList "/" $ref }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}
{{- $ref = join "/" (rest $parts) }}
{{- end }}
{{- $ref = printf "%s/%s" $registry $ref }}
{{- end }}
{{- $ref }}
{{- end }}

{{- define "specgate.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- include "specgate.withRegistry" (list $ref (.Values.global).imageRegistry) }}
{{- end }}

{{- define "specgate.engineImage" -}}
{{- include "specgate.withRegistry" (list .Values.operator.engineImage (.Values.global).imageRegistry) }}
{{- end }}

{{/* The one place values become `specgate operator` flags. */}}
{{- define "specgate.operatorArgs" -}}
- operator
{{- with .Values.operator.watchNamespaces }}
{{- range . }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --engine-image={{ include "specgate.engineImage" . }}
- --router-image={{ include "specgate.image" . }}
{{- range .Values.imagePullSecrets }}
- --image-pull-secret={{ .name }}
{{- end }}
{{- range .Values.operator.policy.allowedImagePrefixes }}
- --allowed-image-prefix={{ . }}
{{- end }}
{{- range .Values.operator.policy.allowedHostPathPrefixes }}
- --allowed-host-path-prefix={{ . }}
{{- end }}
{{- if .Values.operator.policy.allowEnvSecrets }}
- --allow-env-secrets
{{- end }}
{{- if .Values.operator.policy.allowUnlabelledSecrets }}
- --allow-unlabelled-secrets
{{- end }}
{{- range .Values.operator.policy.allowedHubEndpoints }}
- --allowed-hub-endpoint={{ . }}
{{- end }}
{{- range .Values.operator.policy.allowedTolerationKeys }}
- --allowed-toleration-key={{ . }}
{{- end }}
{{- range .Values.operator.policy.allowedRuntimeClasses }}
- --allowed-runtime-class={{ . }}
{{- end }}
{{- range .Values.operator.policy.allowedPriorityClasses }}
- --allowed-priority-class={{ . }}
{{- end }}
- --max-shm-size={{ .Values.operator.policy.maxShmSize }}
- --max-cache-size={{ .Values.operator.policy.maxCacheSize }}
- --resync-seconds={{ .Values.operator.resyncSeconds }}
- --liveness=http://0.0.0.0:8080/healthz
- --metrics-port=8081
- --leader-election-namespace=$(POD_NAMESPACE)
- --leader-election-lease={{ include "specgate.fullname" . }}
{{- range $key, $value := .Values.operator.metricsNamespaceLabels }}
- --metrics-namespace-label={{ $key }}={{ $value }}
{{- end }}
{{- /* One scrape path a pod: the chart's PodMonitors replace the operator's ServiceMonitors. */}}
{{- if or (not .Values.operator.serviceMonitors) .Values.monitoring.podMonitor.enabled }}
- --no-service-monitor
{{- else }}
{{- range $key, $value := merge (dict) .Values.operator.serviceMonitorLabels .Values.monitoring.labels }}
- --service-monitor-label={{ $key }}={{ $value }}
{{- end }}
{{- end }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- end }}

{{/* What the operator needs in each namespace it watches (install.NAMESPACED_RULES). */}}
{{- define "specgate.namespacedRules" -}}
# The resource: kopf watches it, patches finalizers and annotations, writes status.
- apiGroups: [specgate.io]
  resources: [specdecodedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [specgate.io]
  resources: [specdecodedeployments/status]
  verbs: [get, patch]
# Events about handler outcomes.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Children (server-side apply creates through PATCH); those whose changes the operator follows
# at once are listed and watched too. Secrets are not: that would read every Secret.
- apiGroups: [""]
  resources: [secrets, serviceaccounts]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, delete]
# RBAC forbids granting what one does not hold: each router's Role needs these.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, patch]
{{- end }}

{{/*
Labels of a monitoring object: monitoring.labels, then the object's own (which win).
Called with (list $ ownLabels).
*/}}
{{- define "specgate.monitoringLabels" -}}
{{- $root := index . 0 -}}
{{- $labels := merge (dict) (index . 1 | default dict) $root.Values.monitoring.labels -}}
{{- with $labels }}
{{- toYaml . }}
{{- end }}
{{- end }}
