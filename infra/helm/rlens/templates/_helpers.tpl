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

{{/* A start (imports, the pool, the broker's topics) may take minutes on a busy node: the startupProbe allows 5,
and the liveness probe only starts once it passed. */}}
{{- define "rlens.probes" -}}
startupProbe: {httpGet: {path: /healthz, port: {{ . }}}, periodSeconds: 5, failureThreshold: 60}
livenessProbe: {httpGet: {path: /healthz, port: {{ . }}}, periodSeconds: 10, failureThreshold: 3}
readinessProbe: {httpGet: {path: /readyz, port: {{ . }}}, periodSeconds: 5}
{{- end -}}

{{/* Pod Security "restricted": no privilege escalation, no capabilities, the runtime's seccomp profile, a read-only
root (each process writes only /tmp, an emptyDir, and the learner its checkpoint volume). */}}
{{- define "rlens.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  runAsNonRoot: true
  capabilities: {drop: [ALL]}
{{- end -}}

{{/* What every pod spec shares: no API token (rlens never calls the Kubernetes API), the pod's security context,
node placement (replicas of a component on different nodes where the scheduler can). Call with (list . "worker"). */}}
{{- define "rlens.podSpec" -}}
{{- $root := index . 0 -}}
automountServiceAccountToken: false
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels: {{- include "rlens.selector" . | nindent 14 }}
securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
{{- with $root.Values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The partitions of the queries topic (config.kafka.partitions, rlens's default 4): no more workers than these
can take queries, so replicas beyond them would idle. */}}
{{- define "rlens.partitions" -}}
{{- dig "kafka" "partitions" 4 .Values.config | int -}}
{{- end -}}

{{/* The workers' consumer group, as rlens names it (config.worker.group, else the topic prefix's: rlens-workers). */}}
{{- define "rlens.workersGroup" -}}
{{- $prefix := regexReplaceAll "[._-]+$" (dig "kafka" "topic_prefix" "rlens." .Values.config) "" | default "rlens" -}}
{{- dig "worker" "group" (printf "%s-workers" $prefix) .Values.config -}}
{{- end -}}
