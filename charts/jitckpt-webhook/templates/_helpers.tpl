{{/* The chart's name: app.kubernetes.io/name. */}}
{{- define "jitckpt-webhook.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name; the release's own when it contains the chart's (jitckpt-webhook).
Also the Service's name, so a DNS label: 63 characters at most. */}}
{{- define "jitckpt-webhook.fullname" -}}
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

{{- define "jitckpt-webhook.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "jitckpt-webhook.selectorLabels" -}}
app.kubernetes.io/name: {{ include "jitckpt-webhook.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "jitckpt-webhook.labels" -}}
helm.sh/chart: {{ include "jitckpt-webhook.chart" . }}
{{ include "jitckpt-webhook.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: jitckpt
{{- end }}

{{- define "jitckpt-webhook.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The Secret the pods mount: tls.crt, tls.key and ca.crt (cert-manager's or Helm's). */}}
{{- define "jitckpt-webhook.tlsSecret" -}}
{{- printf "%s-tls" (include "jitckpt-webhook.fullname" .) }}
{{- end }}

{{/* cert-manager's CA: its Certificate, the Secret it fills and the Issuer that signs with it. */}}
{{- define "jitckpt-webhook.caName" -}}
{{- printf "%s-ca" (include "jitckpt-webhook.fullname" .) }}
{{- end }}

{{/* The names the serving certificate is for: the Service's, in the release's namespace. */}}
{{- define "jitckpt-webhook.dnsNames" -}}
{{- $svc := include "jitckpt-webhook.fullname" . }}
- {{ printf "%s.%s.svc" $svc .Release.Namespace }}
- {{ printf "%s.%s.svc.cluster.local" $svc .Release.Namespace }}
{{- end }}
