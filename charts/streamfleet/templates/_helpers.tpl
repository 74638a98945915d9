{{- define "streamfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "streamfleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "streamfleet.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "streamfleet.serviceAccountName" -}}
{{- default (include "streamfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "streamfleet.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Where the pods listen: every address, or the pod IP only. */}}
{{- define "streamfleet.listenHost" -}}
{{- if eq .Values.listenOn "podIP" -}}$(POD_IP){{- else -}}0.0.0.0{{- end -}}
{{- end -}}

{{- define "streamfleet.selectorLabels" -}}
app.kubernetes.io/name: streamfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "streamfleet.labels" -}}
{{ include "streamfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* The Secret holding the key of the pod templates' Secrets digest. */ -}}
{{- define "streamfleet.digestKeySecret" -}}
{{- printf "%s-digest-key" (include "streamfleet.fullname" .) -}}
{{- end -}}

{{- define "streamfleet.leaseName" -}}
{{- default (printf "%s-leader" (include "streamfleet.fullname" .)) .Values.leaderElection.leaseName -}}
{{- end -}}

{{- /* imagePullSecrets ([{name: a}, ...]) as "a,b". */ -}}
{{- define "streamfleet.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{- define "streamfleet.consoleSelectorLabels" -}}
app.kubernetes.io/name: streamfleet-console
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "streamfleet.consoleLabels" -}}
{{ include "streamfleet.consoleSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
