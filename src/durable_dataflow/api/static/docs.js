// Starts Swagger UI on the API reference page (/ui/docs) over the OpenAPI document this session reads.
// Served from this origin: the page's policy allows no inline script.
window.addEventListener("DOMContentLoaded", function () {
  window.ui = SwaggerUIBundle({
    url: "/ui/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
    validatorUrl: null, // never the public validator: nothing leaves this server
    persistAuthorization: false,
  });
});
