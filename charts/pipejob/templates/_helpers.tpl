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
