{{/* Names, labels and the few decisions several templates share. */}}

{{- define "pipejob.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pipejob.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pipejob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pipejob.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pipejob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pipejob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pipejob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pipejob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pipejob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" when the operator replicas coordinate through kopf peering: always with more
than one replica (otherwise they would all handle every job), or when asked for. */}}
{{- define "pipejob.peering" -}}
{{- if or .Values.peering.enabled (gt (int .Values.replicas) 1) }}true{{ end }}
{{- end }}

{{/* The peering object's name: one per release. */}}
{{- define "pipejob.peeringName" -}}
{{- default (include "pipejob.fullname" .) .Values.peering.name }}
{{- end }}

{{/* PIPEJOB_NETWORK_POLICY, the NetworkPolicy of each job's world: "off", or as JSON the peers
that may also read the masters' monitor port (the operator's own pods first: it polls
/progress there) and, with restrictEgress, the egress rules the worlds may use. */}}
{{- define "pipejob.jobsNetworkPolicy" -}}
{{- $jobs := .Values.networkPolicy.jobs -}}
{{- if $jobs.enabled -}}
{{- $namespace := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) -}}
{{- $pods := dict "matchLabels" (include "pipejob.selectorLabels" . | fromYaml) -}}
{{- $operator := dict "namespaceSelector" $namespace "podSelector" $pods -}}
{{- $settings := dict "monitorFrom" (prepend $jobs.monitorFrom $operator) -}}
{{- if $jobs.restrictEgress -}}
{{- $_ := set $settings "egress" $jobs.egress -}}
{{- end -}}
{{- toJson $settings -}}
{{- else -}}
off
{{- end -}}
{{- end }}
