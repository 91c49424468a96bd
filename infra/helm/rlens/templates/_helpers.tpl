{{/* The release's name for its objects: <release>-rlens, or the release name if it holds "rlens". */}}
{{- define "rlens.fullname" -}}
{{- if contains "rlens" .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- else -}}{{ printf "%s-rlens" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "rlens.labels" -}}
app.kubernetes.io/name: rlens
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component (worker, learner, gateway): include "rlens.selector" (list . "worker") */}}
{{- define "rlens.selector" -}}
app.kubernetes.io/name: rlens
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "rlens.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* What every process's container shares: its configuration file, the common Secret, its HTTP side. */}}
{{- define "rlens.env" -}}
- {name: RLENS_CONFIG, value: /etc/rlens/rlens.toml}
- {name: RLENS_METRICS_HOST, value: 0.0.0.0}
- {name: RLENS_METRICS_PORT, value: {{ .Values.metricsPort | quote }}}
{{- end -}}

{{- define "rlens.podAnnotations" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{- define "rlens.probes" -}}
livenessProbe: {httpGet: {path: /healthz, port: {{ . }}}, periodSeconds: 10, failureThreshold: 3}
readinessProbe: {httpGet: {path: /readyz, port: {{ . }}}, periodSeconds: 5}
{{- end -}}
